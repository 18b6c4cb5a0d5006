"""Streamed corpora (`gated_attention.training.streaming`) against the in-memory packing of the same documents.

The reference is `data.pack(data.token_stream(...))`, the rows the in-memory
path cuts; a stream must give exactly those rows (same tokens, same order),
per process the rows of its part of the documents, and after a resume from
any saved position the rows an uninterrupted stream gives. Corpora are tiny
files written here from the embedded corpus; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gated_attention.training import data
from gated_attention.files.datasets import DataError, open_text_dataset
from gated_attention.training.streaming import (
    TokenShards,
    text_stream,
    token_dtype,
    write_token_shards,
)

ROOT = Path(__file__).resolve().parents[1]
MAX_CHARS = 150_000
SEQ_LEN = 32


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return data.load_tokenizer(300, max_chars=MAX_CHARS, cache=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """120 documents of 300 characters (short, so that chunks of a few documents matter)."""
    text = "".join(d.text for d in data.corpus_split("train", MAX_CHARS))
    return [text[i : i + 300] for i in range(0, 120 * 300, 300)]


def packed(tokenizer, texts: list[str]) -> torch.Tensor:
    stream = data.token_stream(tokenizer, [data.Document(str(i), t) for i, t in enumerate(texts)])
    return data.pack(stream, SEQ_LEN, tokenizer.bos_token_id)


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({field: t, "id": i}) + "\n")
    return path


def write_corpus(kind: str, folder: Path, texts: list[str]) -> str:
    if kind == "jsonl":
        return str(write_jsonl(folder / "c.jsonl", texts))
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), folder / "c.parquet", row_group_size=16)
        return str(folder / "c.parquet")
    if kind == "csv":
        import pandas as pd

        pd.DataFrame({"text": texts}).to_csv(folder / "c.csv", index=False)
        return str(folder / "c.csv")
    if kind == "txt":  # one file per document, as --text-files reads them
        sub = folder / "txt"
        sub.mkdir()
        for i, t in enumerate(texts):
            (sub / f"{i:04d}.txt").write_text(t, encoding="utf-8")
        return str(sub)
    if kind == "saved":
        from datasets import Dataset

        Dataset.from_dict({"text": texts}).save_to_disk(str(folder / "saved"))
        return str(folder / "saved")
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv", "txt", "saved"])
def test_stream_gives_the_in_memory_rows(tokenizer, docs, tmp_path, kind):
    spec = write_corpus(kind, tmp_path, docs)
    reference = packed(tokenizer, docs)
    stream = text_stream(spec, tokenizer, SEQ_LEN, chunk_docs=8)
    assert torch.equal(stream.next_rows(len(reference)), reference)
    # Then the next epoch: unlike `pack`, the stream keeps the tail that filled no row, so the next
    # row is that tail followed by the first tokens of the corpus.
    tail = data.token_stream(tokenizer, [data.Document(str(i), t) for i, t in enumerate(docs)])
    leftover = len(tail) - len(reference) * (SEQ_LEN - 1)
    row = stream.next_rows(1)[0]
    assert torch.equal(row[1 : 1 + leftover], torch.from_numpy(tail[len(tail) - leftover :]).long())
    assert torch.equal(row[1 + leftover :], torch.from_numpy(tail[: SEQ_LEN - 1 - leftover]).long())


def test_two_processes_read_disjoint_parts(tokenizer, docs, tmp_path):
    """Two files: one file per process (datasets' "shards" split). One file: every other document."""
    half = len(docs) // 2
    files = [str(write_jsonl(tmp_path / "a.jsonl", docs[:half])), str(write_jsonl(tmp_path / "b.jsonl", docs[half:]))]
    for rank, part in enumerate([docs[:half], docs[half:]]):
        reference = packed(tokenizer, part)
        stream = text_stream(files, tokenizer, SEQ_LEN, rank=rank, world=2, chunk_docs=8)
        assert torch.equal(stream.next_rows(len(reference)), reference)

    one = str(write_jsonl(tmp_path / "all.jsonl", docs))
    for rank in range(2):
        reference = packed(tokenizer, docs[rank::2])
        stream = text_stream(one, tokenizer, SEQ_LEN, rank=rank, world=2, chunk_docs=8)
        assert torch.equal(stream.next_rows(len(reference)), reference)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_resume_at_every_row_boundary(tokenizer, docs, tmp_path, kind):
    """Positions inside the first chunk, in later chunks (a saved `datasets` state) and in the second epoch."""
    spec = write_corpus(kind, tmp_path, docs[:12])
    stream = text_stream(spec, tokenizer, SEQ_LEN, rank=1, world=2, chunk_docs=3)
    states, rows = [], []
    for _ in range(60):  # one process's part of 12 documents is far less than 60 rows: this wraps
        states.append(json.loads(json.dumps(stream.state_dict())))  # what a checkpoint holds
        rows.append(stream.next_rows(1))
    rows = torch.cat(rows)
    assert {s["epoch"] for s in states} >= {0, 1}
    assert any(s["chunk"] is not None for s in states)
    for k in range(0, 60, 7):
        resumed = text_stream(spec, tokenizer, SEQ_LEN, rank=1, world=2, chunk_docs=3)
        resumed.load_state_dict(states[k])
        assert torch.equal(resumed.next_rows(4), rows[k : k + 4]), f"resumed at row {k}: {states[k]}"


def test_resume_with_other_settings_is_refused(tokenizer, docs, tmp_path):
    spec = write_corpus("jsonl", tmp_path, docs)
    state = text_stream(spec, tokenizer, SEQ_LEN).state_dict()
    with pytest.raises(DataError, match="world=1"):
        text_stream(spec, tokenizer, SEQ_LEN, world=2).load_state_dict(state)


def test_bad_text_field_and_bad_paths_are_one_line_errors(tokenizer, docs, tmp_path):
    spec = write_corpus("parquet", tmp_path, docs)
    with pytest.raises(DataError, match=r"--text-field 'body': .* \(its columns: text\)"):
        text_stream(spec, tokenizer, SEQ_LEN, text_field="body")
    with pytest.raises(DataError, match="no such file or folder"):
        open_text_dataset(str(tmp_path / "missing.jsonl"))
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(DataError, match="unknown file kind"):
        open_text_dataset(str(tmp_path / "notes.md"))


def test_hub_id_is_read_from_the_local_cache_offline(tokenizer, docs, tmp_path, monkeypatch):
    """A dataset repo in huggingface_hub's cache layout, with HF_HUB_OFFLINE set: no network is tried."""
    from huggingface_hub import constants

    commit = "0" * 40
    repo = tmp_path / "hub" / "datasets--someone--corpus"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit / "data").mkdir(parents=True)
    write_jsonl(repo / "snapshots" / commit / "data" / "train.jsonl", docs)
    write_jsonl(repo / "snapshots" / commit / "data" / "validation.jsonl", docs[:5])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    reference = packed(tokenizer, docs)
    stream = text_stream("someone/corpus", tokenizer, SEQ_LEN)
    assert torch.equal(stream.next_rows(len(reference)), reference)
    valid = text_stream("someone/corpus", tokenizer, SEQ_LEN, split="validation")
    assert torch.equal(valid.next_rows(2), packed(tokenizer, docs[:5])[:2])
    with pytest.raises(DataError, match="not in the Hugging Face cache"):
        open_text_dataset("someone/other")


def test_token_shards_random_access(tokenizer, docs, tmp_path):
    spec = write_corpus("jsonl", tmp_path, docs)
    index = write_token_shards(spec, tokenizer, tmp_path / "tokens", shard_tokens=1000)  # many shards
    assert index["dtype"] == "uint16" and len(index["shards"]) > 3
    assert {p.name for p in (tmp_path / "tokens").iterdir()} == {"index.json"} | {s["file"] for s in index["shards"]}
    reference = packed(tokenizer, docs)
    rows = TokenShards(tmp_path / "tokens", SEQ_LEN, tokenizer)
    assert len(rows) == len(reference)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))
    assert torch.equal(rows[order], reference[order])  # rows that cross shard files included
    assert torch.equal(rows[:3], reference[:3])
    with pytest.raises(DataError, match="exists"):
        write_token_shards(spec, tokenizer, tmp_path / "tokens")
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32


def test_token_shards_of_no_text_or_interrupted_leave_nothing_behind(tokenizer, docs, tmp_path):
    """An empty corpus is one error (it was an IndexError from the tokenizer, called on no texts), and an
    interruption half-way removes the temporary folder and the folders made for it."""
    (tmp_path / "empty.txt").write_text("")
    write_jsonl(tmp_path / "blank.jsonl", ["", "", ""])
    spec = write_corpus("jsonl", tmp_path, docs)
    for empty, message in (("empty.txt", "the file is empty"), ("blank.jsonl", "no text to tokenize")):
        with pytest.raises(DataError, match=message):
            write_token_shards(str(tmp_path / empty), tokenizer, tmp_path / "new" / "tokens")
        assert not (tmp_path / "new").exists()

    chunks = []

    class InterruptedAtTheThirdChunk:  # the tokenizer, but Ctrl-C arrives while it tokenizes the third chunk
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __len__(self):
            return len(tokenizer)

        def __call__(self, texts, **kwargs):
            chunks.append(len(texts))
            if len(chunks) == 3:
                raise KeyboardInterrupt
            return tokenizer(texts, **kwargs)

    with pytest.raises(KeyboardInterrupt):
        write_token_shards(spec, InterruptedAtTheThirdChunk(), tmp_path / "new" / "tokens",
                           shard_tokens=1000, chunk_docs=8)
    assert len(chunks) == 3 and not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    chunks.clear()
    with pytest.raises(KeyboardInterrupt):
        write_token_shards(spec, InterruptedAtTheThirdChunk(), tmp_path / "kept" / "tokens",
                           shard_tokens=1000, chunk_docs=8)
    assert (tmp_path / "kept").exists() and not any((tmp_path / "kept").iterdir())  # it was there before


def test_bad_text_field_exits_with_one_line(tokenizer, docs, tmp_path):
    """The example script, as a user runs it: exit status 2, one line on stderr, no traceback."""
    spec = write_corpus("jsonl", tmp_path, docs[:4])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "examples"), str(ROOT)]), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "examples" / "continued_pretraining.py"), "--model", str(tokenizer.name_or_path),
           "--output-dir", str(tmp_path / "out"), "--dataset", spec, "--text-field", "content"]
    # The tokenizer folder is no model: the data are opened first, so the error is about the field.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"error: --text-field 'content': {spec} has no such column (its columns: text, id)"], proc.stderr


# ---------------------------------------------------------------- documents of any length: tokenized in pieces


class RecordingTokenizer:
    """The tokenizer, noting how many characters each call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __len__(self):
        return len(self.tokenizer)

    def __call__(self, texts, **kwargs):
        self.calls.append(sum(map(len, texts)) if isinstance(texts, list) else len(texts))
        return self.tokenizer(texts, **kwargs)


def test_text_pieces_cut_before_a_space_and_hard_only_without_one():
    text = "alpha  beta\tgamma\n  delta " * 40 + "x" * 500 + " tail"
    pieces = list(data.text_pieces(text, 100))
    assert "".join(pieces) == text and all(len(p) <= 100 for p in pieces)
    starts = [sum(map(len, pieces[:i])) for i in range(1, len(pieces))]
    at_space = [c for c in starts if text[c] == " " and not text[c - 1].isspace()]
    hard = [c for c in starts if c not in at_space]
    assert at_space and hard and all(text[c - 1] == "x" and text[c] == "x" for c in hard)  # only in the x run
    assert list(data.text_pieces("short", 100)) == ["short"] and list(data.text_pieces("", 100)) == [""]


def test_documents_cut_into_pieces_give_the_whole_documents_tokens(tokenizer):
    """The embedded byte-level BPE: every cut before a space is exact, so pieces of 1,000 characters give,
    token for token, what each whole document gives (code and prose: indentation, runs of spaces, tabs).
    With `max_chars` 8,000, a longer document is cut into pieces of 8,000 / 8 characters, 8 to a call."""
    assert data.cuts_are_exact(tokenizer)
    texts = [d.text for d in data.corpus_split("train", MAX_CHARS)]
    cuts = [(text, len("".join(pieces[:i]))) for text in texts
            for pieces in [list(data.text_pieces(text, 1_000))] for i in range(1, len(pieces))]
    assert len(cuts) > 50 and all(text[c] == " " for text, c in cuts)  # no hard cut in this text
    assert sum(len(text) > 8_000 for text in texts) >= 2
    eos = tokenizer.eos_token_id
    whole = [t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]]
    recording = RecordingTokenizer(tokenizer)
    pieces = np.concatenate(list(data.encode_documents(recording, texts, max_chars=8_000)))
    assert pieces.tolist() == whole
    assert max(recording.calls) <= 8_000


def test_text_without_spaces_is_cut_hard_and_still_encodes_the_same_text(tokenizer):
    text = "x=" + "abcdefgh" * 200
    tokens = np.concatenate(list(data.encode_documents(tokenizer, [text], max_chars=300)))
    assert tokens[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(tokens[:-1].tolist()) == text


def test_a_long_document_streams_in_pieces_with_the_whole_documents_rows(tokenizer, tmp_path):
    """A 60,000-character document between two short ones, streamed with `piece_chars` 8,000 (pieces of 1,000
    characters, 8 to a call): no tokenizer call is given more than 8,000 characters (the whole document in
    one call took 200 bytes of memory per character), the rows are those of the whole documents, and a
    resume inside the long document re-tokenizes only its chunk."""
    long_doc = " ".join(d.text for d in data.corpus_split("train", MAX_CHARS))[:60_000]
    texts = ["a short one", long_doc, "the last one"]
    spec = str(write_jsonl(tmp_path / "long.jsonl", texts))
    eos = tokenizer.eos_token_id
    whole = np.asarray([t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]])
    reference = data.pack(whole, SEQ_LEN, tokenizer.bos_token_id)
    recording = RecordingTokenizer(tokenizer)
    stream = text_stream(spec, recording, SEQ_LEN, piece_chars=8_000)
    first = stream.next_rows(10)
    state = json.loads(json.dumps(stream.state_dict()))
    assert torch.equal(torch.cat([first, stream.next_rows(len(reference) - 10)]), reference)
    assert recording.calls and max(recording.calls) <= 8_000

    resumed = text_stream(spec, tokenizer, SEQ_LEN, piece_chars=8_000)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_rows(len(reference) - 10), reference[10:])


def test_a_tokenizer_that_adds_a_token_per_call_is_warned_about(tokenizer, tmp_path):
    """Llama 2's SentencePiece tokenizer prepends "▁" to every call; cut documents then get an extra token at
    each cut, which the stream says once."""
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast

    prepending = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer.__class__.from_str(
        tokenizer.backend_tokenizer.to_str()), bos_token="<|bos|>", eos_token="<|eos|>")
    prepending.backend_tokenizer.normalizer = normalizers.Prepend("▁")
    assert not data.cuts_are_exact(prepending)
    spec = str(write_jsonl(tmp_path / "long.jsonl", ["word " * 2_000]))
    with pytest.warns(UserWarning, match="tokenized in pieces"):
        text_stream(spec, prepending, SEQ_LEN, piece_chars=1_000).next_rows(2)


def test_a_json_file_with_a_long_first_line_opens_without_the_python_prescan(tmp_path, monkeypatch):
    """datasets parses a json file's first batch into Python objects too when it opens it (a 50 MB line took
    460 MB), to find fields whose keys or type change from line to line, which it then stores as JSON text.
    With a long first line that pass is left out: keys that change are pyarrow's to merge (a struct, not
    JSON text), and where pyarrow cannot read the first batch (a type that changes in it) the file is opened
    again as datasets opens it. The documents are the same either way. `JSON_CHUNK` is made small here, so
    that a line of 100 characters counts as long."""
    import gated_attention.files.datasets as hub_datasets

    def lines(path: Path, metas: list[dict]) -> Path:
        path.write_text("".join(json.dumps({"text": f"document {i} " * 10, "meta": m}) + "\n" for i, m in enumerate(metas)))
        return path

    keys = lines(tmp_path / "keys.jsonl", [{"a": 1}, {"b": 2}])  # meta's keys change
    types = lines(tmp_path / "types.jsonl", [{"x": 1}, {"x": "s"}])  # meta.x: a number, then a string
    texts = [f"document {i} " * 10 for i in range(2)]
    assert "Json" in str(open_text_dataset(str(keys)).features["meta"])  # datasets' prescan at work
    monkeypatch.setattr(hub_datasets, "JSON_CHUNK", 16)
    for path, meta in ((keys, "{'a': Value('int64'), 'b': Value('int64')}"), (types, "{'x': Json(decode=True)}")):
        ds = open_text_dataset(str(path))
        assert str(ds.features["meta"]) == meta
        assert [d["text"] for d in ds] == texts
