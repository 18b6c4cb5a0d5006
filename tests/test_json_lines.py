"""`files.json_lines`: JSON-lines files read a line at a time, a long line's text decoded a part at a time.

The reference is `json.loads` of each whole line (and, for the stream's rows, `datasets`' json builder). The
module's sizes (`LONG_LINE`, `BLOCK`, `PART`) are made a few bytes here, so that short texts take every path
of a 50 MB line: lines scanned in blocks, strings decoded in parts whose cuts fall inside escapes, surrogate
pairs and UTF-8 characters.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from gated_attention.files import json_lines
from gated_attention.files.datasets import DataError, open_text_dataset
from gated_attention.files.json_lines import JsonLinesCorpus
from gated_attention.training import data
from gated_attention.training.streaming import PackedStream, check_corpus, open_corpus, text_stream

# Characters whose JSON takes every form: plain, escaped (\n, \", \\, \u0001), raw or escaped non-ASCII
# (two- and three-byte UTF-8, a surrogate pair), spaces to cut pieces at.
ALPHABET = ["a", "b", " ", "  ", "\n", "\t", '"', "\\", "é", "日", "😀", "\u2028", "/", "\x01", "zzzzz"]
SIZES = [(1 << 20, 1 << 20, 1 << 18), (64, 16, 16), (100, 7, 17), (10, 3, 16), (30, 5, 23)]  # LONG_LINE, BLOCK, PART


def random_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for i in range(n):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.choice([0, 1, 5, 50, 400, 3000])))
        record = ({"id": i, "meta": {"x": [1, 'q"}', {"y": None}]}, "text": text} if i % 3
                  else {"text": text, "n": -1.5e3})
        if i % 7 == 0:
            record = {"other": 1}
        if i % 11 == 0:
            record["text"] = None
        records.append(record)
    return records


def write(path: Path, records: list[dict], seed: int = 0) -> Path:
    """One record a line, ASCII-escaped or raw UTF-8 at random, with blank lines between some."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i, record in enumerate(records):
            f.write(json.dumps(record, ensure_ascii=rng.random() < 0.5) + ("\n\n" if i % 13 == 0 else "\n"))
    return path


def texts(chunk: list) -> list:
    """A chunk's documents, a long one's parts joined."""
    return [v if v is None or isinstance(v, (str, int, float)) else "".join(v) for v in chunk]


@pytest.fixture(params=SIZES, ids=lambda s: "long_line={}".format(s[0]))
def sizes(request, monkeypatch):
    for name, value in zip(("LONG_LINE", "BLOCK", "PART"), request.param):
        monkeypatch.setattr(json_lines, name, value)
    return request.param


def test_documents_are_json_loads_of_each_line_in_every_chunk_split_and_resume(tmp_path, sizes):
    records = random_records(300)
    corpus = JsonLinesCorpus([str(write(tmp_path / "a.jsonl", records))], "a.jsonl")
    want = [r.get("text") for r in records]
    chunks = list(corpus.chunks("text", 0, 1, None, 17))
    assert [t for chunk, _ in chunks for t in texts(chunk)] == want
    for k, (_, position) in enumerate(chunks[:-1]):  # a resume from each chunk's end reads the next chunk
        position = json.loads(json.dumps(position))
        assert texts(next(corpus.chunks("text", 0, 1, position, 17))[0]) == want[(k + 1) * 17 : (k + 2) * 17]
    for rank in range(3):  # one file, three processes: every third document
        mine = [t for chunk, _ in corpus.chunks("text", rank, 3, None, 5) for t in texts(chunk)]
        assert mine == want[rank::3]
    assert corpus.columns()[:2] == ["other", "text"] and set(corpus.columns()) == {k for record in records for k in record} and corpus.has_text("text") and not corpus.has_text("nope")


def test_two_files_over_two_processes_are_a_file_each(tmp_path, sizes):
    a, b = random_records(40, seed=1), random_records(30, seed=2)
    corpus = JsonLinesCorpus([str(write(tmp_path / "a.jsonl", a)), str(write(tmp_path / "b.jsonl", b))], "a b")
    for rank, records in enumerate((a, b)):
        assert [t for chunk, _ in corpus.chunks("text", rank, 2, None, 8) for t in texts(chunk)] == \
            [r.get("text") for r in records]


def test_a_long_strings_parts_are_bounded_and_end_between_characters(tmp_path, monkeypatch):
    monkeypatch.setattr(json_lines, "LONG_LINE", 64)
    monkeypatch.setattr(json_lines, "PART", 16)
    text = "日本 😀 é \\ \" \n" * 50
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": text}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    (first, second), _ = next(JsonLinesCorpus([str(path)], "long.jsonl").chunks("text", 0, 1, None, 2))
    for document in (first, second):
        parts = list(document)
        assert "".join(parts) == text and len(parts) > 20 and max(map(len, parts)) <= 16
        assert not any("\ud800" <= c <= "\udfff" for part in parts for c in part)  # no half surrogate pair


def test_a_byte_order_mark_and_a_last_line_without_newline_are_read(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"text": "one"}\n\n  \n{"text": "two"}')
    assert texts(next(JsonLinesCorpus([str(path)], "bom.jsonl").chunks("text", 0, 1, None, 5))[0]) == ["one", "two"]


BAD_LINES = {
    "not an object": ('[1, 2]', "line 2 cannot be read (the line holds list, not an object)"),
    "truncated": ('{"text": "abc", "x": [1, 2', "line 2 cannot be read (Expecting ',' delimiter at character 27)"),
    "long, not closed": ('{"text": "' + "a" * 200, "line 2 cannot be read (a string is not closed)"),
    "long, more after": ('{"text": "' + "a" * 200 + '"} x',
                         "line 2 cannot be read (more after the object, at byte 212)"),
    "long, bad escape": ('{"text": "' + "a" * 200 + '\\q"}', "line 2 cannot be read (Invalid \\escape)"),
    "long, a list": ('{"text": [' + "1," * 150 + "1]}", "line 2 cannot be read (its 'text' value is 303 bytes of "
                     "JSON, not a string)"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_line_is_one_line_naming_it(tmp_path, monkeypatch, case):
    monkeypatch.setattr(json_lines, "LONG_LINE", 64)
    line, message = BAD_LINES[case]
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError) as error:  # a long string's escapes are decoded as its parts are read
        [texts(chunk) for chunk, _ in open_corpus(str(path)).chunks("text", 0, 1, None, 4)]
    assert str(error.value) == f"--dataset {path}: {message}"
    for document in next(open_corpus(str(path)).chunks("text", 0, 1, None, 1))[0]:
        assert document == "fine"  # the lines before it are read


def test_long_values_that_are_not_text_are_named_by_the_stream(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setattr(json_lines, "LONG_LINE", 64)
    path = tmp_path / "number.jsonl"
    path.write_text(json.dumps({"pad": "a" * 200, "text": 12}) + "\n")
    with pytest.raises(DataError, match="--text-field 'text': .*number.jsonl's column holds int, not text"):
        text_stream(str(path), tokenizer, 16).next_rows(1)
    null = tmp_path / "null.jsonl"
    null.write_text(json.dumps({"text": None, "pad": "a" * 200}) + "\n")
    with pytest.raises(DataError, match="no document has text"):
        check_corpus(open_corpus(str(null)), "text", str(null))
    with pytest.raises(DataError, match=r"has no such column \(its columns: text, pad\)"):
        check_corpus(open_corpus(str(null)), "body", str(null))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return data.load_tokenizer(300, max_chars=150_000, cache=tmp_path_factory.mktemp("cache"))


def test_the_stream_gives_datasets_rows_with_long_lines_read_in_parts(tmp_path, monkeypatch, tokenizer):
    """The same file through `datasets`' json builder (the reference: each line parsed whole) and through
    the JSON-lines reader with every line of more than 64 bytes long: the same rows, in 2 processes."""
    monkeypatch.setattr(json_lines, "LONG_LINE", 64)
    monkeypatch.setattr(json_lines, "PART", 40)
    corpus_text = "".join(d.text for d in data.corpus_split("train", 150_000))
    records = [{"text": corpus_text[i : i + n]} for i, n in zip(range(0, 40_000, 1_000), [30, 900, 5, 400] * 10)]
    path = write(tmp_path / "c.jsonl", records)
    assert isinstance(open_corpus(str(path)), JsonLinesCorpus)
    for rank in range(2):
        ours = text_stream(str(path), tokenizer, 32, rank=rank, world=2, chunk_docs=3, piece_chars=80)
        reference = PackedStream(open_text_dataset(str(path)), tokenizer, 32, rank=rank, world=2, chunk_docs=3,
                                 piece_chars=80)
        assert torch.equal(ours.next_rows(60), reference.next_rows(60))


def test_a_position_of_the_other_reader_is_refused_in_one_line(tmp_path, tokenizer):
    path = str(write(tmp_path / "c.jsonl", [{"text": "some text " * 20}] * 10))
    ours = text_stream(path, tokenizer, 16, chunk_docs=2)
    theirs = PackedStream(open_text_dataset(path), tokenizer, 16, chunk_docs=2, name=path)
    for stream in (ours, theirs):
        stream.next_rows(40)  # past the first chunk: a position that is not the start
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    with pytest.raises(DataError, match="written by another reader"):
        ours.load_state_dict(theirs_state)
    with pytest.raises(DataError, match="written by this package's JSON-lines reader"):
        theirs.load_state_dict(ours_state)


def _resumed(spec, tokenizer, state):
    stream = text_stream(spec, tokenizer, 16, chunk_docs=2)
    stream.load_state_dict(state)
    return stream.next_rows(40)


def test_an_edit_before_the_saved_position_is_refused_naming_the_file(tmp_path, tokenizer):
    """A line edited before the saved offset moved every later line: the resume read from the middle of one and
    blamed it ("line 257 cannot be read"). The position keeps a digest of the bytes read before it: an edit
    there is named, of another length or the same, in the file the position is in or in one passed whole."""
    lines = [json.dumps({"text": f"some text {i} " * 20}) + "\n" for i in range(10)]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(lines))
    stream = text_stream(str(path), tokenizer, 16, chunk_docs=2)
    stream.next_rows(40)
    state = stream.state_dict()
    (read, _), again = state["chunk"]["seen"][0], "; resume with the data it was saved with, or start afresh"
    assert 0 < read < path.stat().st_size
    for edited in ('{"text": "an edited first line"}\n', lines[0].replace("some", "sume")):
        path.write_text(edited + "".join(lines[1:]))
        with pytest.raises(DataError) as error:
            _resumed(str(path), tokenizer, state)
        assert str(error.value) == (f"--dataset {path}: the file changed before the checkpoint's position in it "
                                    f"(its first {read:,} bytes differ){again}")
    path.write_text("".join(lines[:1]))
    with pytest.raises(DataError) as error:
        _resumed(str(path), tokenizer, state)
    assert str(error.value) == (f"--dataset {path}: the file is shorter than the checkpoint's position in it "
                                f"({read:,} bytes read then, {path.stat().st_size:,} now){again}")
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"  # the position in the second file
    first.write_text("".join(lines[:2]))
    second.write_text("".join(lines))
    stream = text_stream([str(first), str(second)], tokenizer, 16, chunk_docs=2)
    stream.next_rows(80)
    state = stream.state_dict()
    assert state["chunk"]["file"] == 1
    with open(first, "a") as f:
        f.write(lines[0])
    with pytest.raises(DataError) as error:
        _resumed([str(first), str(second)], tokenizer, state)
    size = first.stat().st_size
    assert str(error.value) == (f"--dataset {first} {second}: {first} changed since the checkpoint, which had read "
                                f"all of it ({size - len(lines[0]):,} bytes then, {size:,} now){again}")


def test_a_corpus_appended_to_after_the_checkpoint_resumes_with_the_same_rows(tmp_path, tokenizer):
    """Appending is how a corpus grows while a run trains, and it was refused on resume ("the file changed since
    the checkpoint (27,040 bytes then, 29,930 now)"). The bytes before the saved position are those the run
    read, so the resume reads on from it: the same rows as a run that had the appended lines from the start,
    the appended documents in their turn."""
    path = write(tmp_path / "c.jsonl", [{"text": f"some text {i} " * 5} for i in range(10)])
    stream = text_stream(str(path), tokenizer, 16, chunk_docs=2)
    stream.next_rows(20)
    state = stream.state_dict()
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps({"text": f"more words {i} " * 5}) + "\n" for i in range(4)))
    grown = text_stream(str(path), tokenizer, 16, chunk_docs=2)
    grown.next_rows(20)
    expected = grown.next_rows(40)  # past the old end of the file, into the appended documents
    rows = text_stream(str(path), tokenizer, 16, chunk_docs=2)
    rows.load_state_dict(state)
    assert torch.equal(rows.next_rows(40), expected)
    assert "more words 3" in tokenizer.decode(expected.flatten())  # the appended documents were reached


def test_only_local_json_lines_files_are_read_without_datasets(tmp_path):
    (tmp_path / "lines").mkdir()
    lines, array = tmp_path / "lines" / "a.json", tmp_path / "b.json"
    lines.write_text('{"text": "x"}\n')
    array.write_text('[{"text": "x"}]\n')
    pretty = tmp_path / "c.json"
    pretty.write_text(json.dumps({"text": ["x", "y"]}, indent=2))  # one object over several lines
    assert isinstance(open_corpus(str(lines)), JsonLinesCorpus)
    assert not isinstance(open_corpus(str(array)), JsonLinesCorpus)  # a JSON array: datasets reads it
    assert not isinstance(open_corpus(str(pretty)), JsonLinesCorpus)
    assert isinstance(open_corpus(str(tmp_path / "lines")), JsonLinesCorpus)  # a folder of them too


def test_analyze_reads_a_long_line_only_as_far_as_its_inputs_need(tmp_path, monkeypatch):
    """`analyze --dataset` read JSON lines through datasets' builder, each line whole (a 200 MB line peaked at
    7.4 GB): it reads them through the package's reader, and a long text only up to `max_chars`."""
    from gated_attention.analysis.samples import DatasetSpec, dataset_samples

    monkeypatch.setattr(json_lines, "LONG_LINE", 64)
    monkeypatch.setattr(json_lines, "PART", 40)
    decoded = []
    parts = json_lines._string_parts

    def counted(*args):
        for part in parts(*args):
            decoded.append(len(part))
            yield part

    monkeypatch.setattr(json_lines, "_string_parts", counted)
    text = "".join(f"word{i} " for i in range(2000))  # 15,780 characters in one line
    path = write(tmp_path / "long.jsonl", [{"text": "a short one"}, {"text": text}])
    samples = dataset_samples([DatasetSpec((str(path),))], 2, max_chars=100)
    assert [s.text for s in samples] == ["a short one", text[:100]]
    assert 0 < sum(decoded) <= 140  # the parts up to 100 characters, not the 15,780


def test_a_folder_of_json_lines_is_read_by_split_as_datasets_picks_the_files(tmp_path):
    """A folder went to datasets' json builder: a 100 MB line took 986 MB there and 488 MB as a file. Its split's
    files, by datasets' own rule for their names, are read by the package's reader instead."""
    folder = tmp_path / "data"
    (folder / "more").mkdir(parents=True)
    for name in ("train.jsonl", "more/train-2.jsonl", "test.jsonl"):
        write(folder / name, [{"text": name}])
    (folder / "README.md").write_text("a dataset card")
    for split, names in ((None, ["more/train-2.jsonl", "train.jsonl"]), ("test", ["test.jsonl"])):
        corpus = open_corpus(str(folder), split)
        assert isinstance(corpus, JsonLinesCorpus) and corpus.files == [folder / n for n in names], split
        reference = open_text_dataset(str(folder), split)
        assert [d["text"] for d in reference] == [value for _, value in corpus.values("text")]
    (folder / "notes.txt").write_text("another kind")
    with pytest.raises(DataError, match="mixed file kinds"):  # as datasets' reader of folders refuses it
        open_corpus(str(folder))


def test_rows_differing_in_fields_are_read(tmp_path):
    """A first row without the text field does not make the file's columns: the union over rows does."""
    from gated_attention.files.json_lines import check_corpus, open_corpus

    path = tmp_path / "s.jsonl"
    path.write_text('{"other": 1}\n{"text": "a"}\n{"text": "b", "other": 2}\n')
    corpus = open_corpus(str(path))
    assert corpus.columns() == ["other", "text"]
    check_corpus(corpus, "text", str(path))  # no DataError


def test_no_row_with_the_field_names_the_union(tmp_path):
    from gated_attention.files.datasets import DataError
    from gated_attention.files.json_lines import check_corpus, open_corpus

    path = tmp_path / "s.jsonl"
    path.write_text('{"a": 1}\n{"b": "x"}\n')
    with pytest.raises(DataError, match=r"its columns: a, b"):
        check_corpus(open_corpus(str(path)), "text", str(path))


def _analyze(argv: list[str], capsys) -> tuple[int, list[str]]:
    """`gated-attention analyze` as the console runs it; its exit status and its stderr's lines (a progress
    bar's redraws, ended by carriage returns, are lines of their own)."""
    from gated_attention.cli import main

    capsys.readouterr()
    status = main(["analyze", *argv])
    return status, capsys.readouterr().err.splitlines()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import gated_attention as ga
    from test_analysis_capture import TINY, tiny_tokenizer

    folder = tmp_path_factory.mktemp("model") / "tiny"
    config = ga.GatedAttentionConfig(**{**TINY, "vocab_size": 300, "num_hidden_layers": 2, "max_position_embeddings": 16})
    ga.GatedAttentionForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_rows_without_the_text_field_are_skipped_and_counted_once(tmp_path, capsys, model_dir):
    """A first row lacking --text-field refused the file; then it was read without a word. Each row is judged
    alone, the check reads only up to the first row that has the field, and one line says how many were
    skipped, of all rows when all were read, of those read when --n-per-domain stopped early."""
    path = tmp_path / "s.jsonl"
    path.write_text('{"other": 1}\n{"text": "a"}\n{"text": "b", "other": 2}\n{"text": "c"}\n')
    read = []
    values = JsonLinesCorpus.values

    def counted(self, field):
        for value in values(self, field):
            read.append(value)
            yield value

    corpus = open_corpus(str(path))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(JsonLinesCorpus, "values", counted)
        check_corpus(corpus, "text", str(path))
    assert len(read) == 4  # two rows for the field, then again up to its first text (has_text)
    for n, said in (("4", "1 of 4 rows have"), ("1", "1 of 2 rows read have")):
        status, err = _analyze([str(model_dir), "--out", str(tmp_path / f"out{n}"), "--dataset", str(path),
                                "--n-per-domain", n], capsys)
        assert status == 0
        warnings = [line for line in err if "warning" in line]
        assert warnings == [f"gated-attention analyze: warning: --dataset {path}: {said} no 'text' field; skipped"]
    with open(tmp_path / "out4" / "inputs.csv") as f:
        assert len(f.read().strip().splitlines()) == 1 + 3  # a header and the three rows with text


@pytest.mark.parametrize("world", [1, 2])
def test_the_stream_names_the_first_skipped_row_at_once_and_counts_them_at_the_end(tmp_path, tokenizer, recwarn,
                                                                                 world):
    """Rows without the text field were reported only once the whole file had been read, and rows with a null text
    were skipped without a word. The first row without text is named as it is read; how many there were, of
    each kind, at the end of the first part read to its end. Once a run, by rank 0 alone (of its own part), and
    the count true across a resume."""
    path = write(tmp_path / "s.jsonl", [{"other": 1}] + [{"text": f"some text {i} " * 5} for i in range(1, 10)]
                 + [{"text": None}, {"text": "the last text"}, {"x": 2}])  # lines 1, 3-11, 12, 13, 14
    later = "; such rows are skipped (how many is said once this process's part of the data has been read)"
    part = "" if world == 1 else " in rank 0's part (of 2)"
    counted = "2 of 13 rows" if world == 1 else "2 of 7 rows"  # rank 0 reads rows 0, 2, ..., 12
    for rank in range(world):
        stream = text_stream(str(path), tokenizer, 16, rank=rank, world=world, chunk_docs=2)
        stream.next_rows(6)  # rank 0: past the chunk of line 1, not yet at line 12's
        assert rank or stream.state_dict()["chunk"] is not None
        said = [str(w.message) for w in recwarn if "rows" in str(w.message)]
        assert said == ([f"--dataset {path}: line 1 has no 'text' field{later}"] if rank == 0 else [])
        recwarn.clear()
        resumed = text_stream(str(path), tokenizer, 16, rank=rank, world=world, chunk_docs=2)  # another run
        resumed.load_state_dict(stream.state_dict())
        resumed.next_rows(400)  # several epochs
        said = [str(w.message) for w in recwarn if "rows" in str(w.message)]
        assert said == ([f"--dataset {path}: line 12 has a null 'text'{later}",
                         f"--dataset {path}: {counted}{part} have no 'text' field and 1 a null one; skipped"]
                        if rank == 0 else [])
        recwarn.clear()


NUL_TAILS = {
    "after a line": (b'{"text": "a"}\n{"text": "b"}\n', 100),
    "inside a line": (b'{"text": "a"}\n{"text": "b', 100),
    "longer than a block": (b'{"text": "a"}\n', 50),
}


@pytest.mark.parametrize("case", list(NUL_TAILS))
def test_a_nul_tail_is_refused_in_one_line_naming_where_it_begins(tmp_path, monkeypatch, capsys, model_dir, case):
    """A file ending in NUL bytes (preallocated, or a write cut short) is refused before anything is read,
    naming the byte where the NULs begin: the bytes meant to be there are lost (see the module docstring)."""
    monkeypatch.setattr(json_lines, "BLOCK", 16)  # the NULs found from the end over several blocks
    head, nuls = NUL_TAILS[case]
    path = tmp_path / "s.jsonl"
    path.write_bytes(head + b"\0" * nuls)
    message = (f"--dataset {path}: {path} ends in {nuls} NUL bytes from byte {len(head)} on (space preallocated "
               "for a write that never came, or a write cut short); cut it there to read the rest "
               f"(truncate -s {len(head)} {path})")
    with pytest.raises(DataError) as error:
        check_corpus(open_corpus(str(path)), "text", str(path))
    assert str(error.value) == message
    with pytest.raises(DataError) as error:  # the reader itself, also without the check
        next(open_corpus(str(path)).chunks("text", 0, 1, None, 1))
    assert str(error.value) == message
    status, err = _analyze([str(model_dir), "--out", str(tmp_path / "out"), "--dataset", str(path),
                            "--n-per-domain", "1"], capsys)
    assert status == 2 and err[-1] == f"gated-attention analyze: error: {message}"
    assert not (tmp_path / "out").exists()
    path.write_bytes(head)  # cut where the line says: the rest reads
    check_corpus(open_corpus(str(path)), "text", str(path))
