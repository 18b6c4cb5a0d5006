"""Corpora of any size: Hugging Face `datasets` streams packed on the fly, and pre-tokenized token shards.

Two ways to feed `gated_attention.training.train` a corpus that does not fit in memory:

- **A text stream** (`PackedStream`): `open_corpus` (`files.json_lines`) opens
  local JSON-lines files, given or in a folder, with the package's own reader
  (a line at a time, a very long line never whole), and txt, parquet and csv
  files, folders of them, a dataset saved with `save_to_disk` or a Hub dataset
  from the local cache with `datasets`, always as a stream. Each process reads its own part
  (whole files when their number divides the world size, else every
  world-th document, as `datasets.distributed.split_dataset_by_node`),
  tokenizes documents as rows need them and cuts BOS-led rows exactly as
  `data.pack` does (documents joined by EOS). Memory holds one chunk of
  documents, the tokens of `data.PIECE_CHARS` characters (a longer document
  is tokenized in pieces: `data.text_pieces`) and one row, whatever the corpus
  size or a document's length: a document longer than 4 x PIECE_CHARS bytes
  is decoded from pyarrow's column or the JSON line a part at a time, never
  made one Python string. A file that cannot be read, when it is opened or
  when the rows reach it, is a `DataError` naming it (`files.datasets.reading`).
- **Token shards** (`write_token_shards`, `TokenShards`): the token stream
  written once as flat uint16/uint32 files with an `index.json`; training
  memory-maps them and reads any row at random, so the in-memory path's
  shuffled, (seed, step)-addressed order (`training.StepBatches`) applies
  unchanged.

Resuming a stream: `PackedStream.state_dict()` is the position of the next
unread token, as (epoch, the reader's position before the chunk of documents
holding it, token offset in that chunk); the reader's position is the
JSON-lines reader's (file, byte offset, line, and a digest of the bytes
before it: appended lines resume, an edit before the position is refused) or
the `datasets` state.
Restoring it re-reads one chunk and re-tokenizes it up to the offset, and
continues with the same rows. The position is small JSON; no data is saved.
Chunks are `chunk_docs` documents, so a resume must use the same `chunk_docs`
(checked), and the same reader (a position of the other is one line).

Shuffling: the stream is read in file order (every epoch the same); shuffle a
corpus once when writing it, or use token shards, whose rows are shuffled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from .. import GatedAttentionWarning
from ..files.datasets import DataError, reading
from ..files.json_lines import JsonLinesCorpus, check_corpus, missing_field_notice, open_corpus
from .data import PIECE_CHARS, cuts_are_exact, document_tokens, encode_documents
from .folders import output_folder

CHUNK_DOCS = 256  # documents read and tokenized at a time
INDEX = "index.json"  # marks a token-shard folder
_SHARDS_FORMAT = 1


# ---------------------------------------------------------------------------------------------
# Packing a stream into rows, with a resumable position


class _Chunk:
    """One chunk of this process's documents, tokenized piece by piece as rows need its tokens."""

    def __init__(self, state: dict | None, pieces: Iterator[np.ndarray]):
        self.state = state  # the `datasets` state before the chunk was read
        self.pieces = pieces  # `data.encode_documents` of the chunk's texts
        self.tokens = np.zeros(0, dtype=np.int32)  # the current piece
        self.used = 0  # tokens of the current piece taken
        self.taken = 0  # tokens of the chunk taken: the position within it

    def take(self, n: int) -> np.ndarray:
        """Up to `n` of the next tokens (fewer at a piece's end; none when the chunk is used up)."""
        while self.used == len(self.tokens):
            self.tokens, self.used = next(self.pieces, None), 0
            if self.tokens is None:
                self.tokens = np.zeros(0, dtype=np.int32)
                return self.tokens
        out = self.tokens[self.used : self.used + n]
        self.used += len(out)
        self.taken += len(out)
        return out


class PackedStream:
    """This process's rows `[T]` of a text stream: BOS, then T-1 tokens of documents joined by EOS.

    `dataset` is the whole, unsplit `IterableDataset`, opened once (opening a
    json file reads its first batch of lines to learn the columns); this
    process reads its part of it (`split_dataset_by_node(rank, world)`). At the
    end of the part a new epoch starts from its beginning, so the stream never ends.
    `next_rows(n)` returns `[n, T]` int64; `state_dict()` / `load_state_dict()`
    save and restore the position (see the module docstring).

    Documents are tokenized only as rows need their tokens, in pieces of
    `data.PIECE_CHARS` characters (`data.encode_documents`), so a document of
    any length costs the memory of one piece's tokens besides its text. Cut
    where `data.text_pieces` cuts, the tokens are those of the whole document
    for byte-level BPE tokenizers; for a tokenizer where they are not
    (`data.cuts_are_exact`), a warning says so once, the first time a document
    is cut.
    """

    def __init__(self, dataset, tokenizer, seq_len: int, *, text_field: str = "text",
                 rank: int = 0, world: int = 1, chunk_docs: int = CHUNK_DOCS, name: str = "dataset",
                 piece_chars: int = PIECE_CHARS):
        if seq_len < 2:
            raise ValueError("seq_len must be at least 2 (BOS plus one token)")
        self.dataset, self.tokenizer, self.seq_len = dataset, tokenizer, seq_len
        self.text_field, self.rank, self.world, self.chunk_docs, self.name = text_field, rank, world, chunk_docs, name
        self.piece_chars = piece_chars
        self.bos, self.eos = document_tokens(tokenizer)
        if self.bos is None:
            raise ValueError("the tokenizer has neither a BOS nor an EOS token to start each packed sequence with")
        self._cuts_checked = False
        self._missing_said = self._skipped_said = rank != 0  # one process says each, once a run: `_say_missing`
        check_corpus(dataset, text_field, name, has_text=False)
        self._start(epoch=0, chunk_state=None, offset=0)

    # -- position ---------------------------------------------------------------------------

    def _start(self, epoch: int, chunk_state: dict | None, offset: int) -> None:
        if isinstance(self.dataset, JsonLinesCorpus):
            self._chunks = self.dataset.chunks(self.text_field, self.rank, self.world, chunk_state, self.chunk_docs,
                                               skipped=self._say_skipped)
        else:
            self._chunks = _dataset_chunks(self.dataset, self.text_field, self.rank, self.world, chunk_state,
                                           self.chunk_docs, self.name)
        self._epoch = epoch
        self._next_chunk_state = chunk_state  # the reader's position before the next chunk is read
        self._chunk: _Chunk | None = None
        self._read_in_epoch = 0  # tokens read this epoch (an empty part is an error, not an endless loop)
        self._whole_epoch = chunk_state is None and not offset
        if chunk_state is not None or offset:
            if not self._read_chunk():
                raise DataError(f"{self.name}: the saved stream position is past the data; is it the same corpus?")
            while offset:  # the tokens before the position are tokenized again and dropped
                skipped = len(self._chunk.take(offset))
                if not skipped:
                    raise DataError(f"{self.name}: the saved stream position is past the data; is it the same corpus?")
                offset -= skipped

    def state_dict(self) -> dict:
        """The position of the next unread token (JSON-able)."""
        if self._chunk is not None:
            chunk_state, offset = self._chunk.state, self._chunk.taken
        else:
            chunk_state, offset = self._next_chunk_state, 0
        return {"epoch": self._epoch, "chunk": chunk_state, "offset": int(offset), "seq_len": self.seq_len,
                "chunk_docs": self.chunk_docs, "rank": self.rank, "world": self.world}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seq_len", "chunk_docs", "world"):
            if state[key] != getattr(self, key):
                raise DataError(f"{self.name}: the checkpoint's stream was read with {key}={state[key]}, "
                                f"this run has {getattr(self, key)}; resume with the same settings")
        self._start(state["epoch"], state["chunk"], state["offset"])

    # -- reading ----------------------------------------------------------------------------

    def _texts(self, documents) -> list[str | Iterator[str]]:
        """The documents with text of one chunk: a pyarrow column (`datasets`) or a list (`JsonLinesCorpus`:
        strings, long strings' parts, and whatever else a line holds)."""
        texts = None if isinstance(documents, list) else _documents(documents, self.piece_chars)
        if texts is None:  # as Python objects: a list already, or a column that does not hold strings
            texts = [t for t in (documents if isinstance(documents, list) else documents.to_pylist()) if t]
            wrong = next((t for t in texts if not isinstance(t, (str, Iterator))), None)  # missing, empty: dropped
            if wrong is not None:
                raise DataError(f"--text-field {self.text_field!r}: {self.name}'s column holds "
                                f"{type(wrong).__name__}, not text")
        if not self._cuts_checked and any(not isinstance(t, str) or len(t) > self.piece_chars for t in texts):
            self._cuts_checked = True
            if not cuts_are_exact(self.tokenizer):
                warnings.warn(f"{self.name}: documents longer than {self.piece_chars:,} characters are tokenized in "
                              f"pieces, and this tokenizer ({type(self.tokenizer).__name__}) gives other tokens at "
                              "the cuts than for the whole text (it adds a token at the start of each call, or "
                              "merges across spaces)", GatedAttentionWarning, stacklevel=2)
        return texts

    def _read_chunk(self) -> bool:
        """Make the next chunk of this process's documents current; False at the end of the epoch."""
        state = self._next_chunk_state
        with reading(self.name):
            chunk = next(self._chunks, None)
        if chunk is None:
            self._say_missing(state)
            return False
        documents, self._next_chunk_state = chunk
        texts = self._texts(documents)
        self._chunk = _Chunk(state, self._pieces(texts))
        return True

    def _say_skipped(self, line: str) -> None:
        """At the first JSON line without text to train on (no text field, or null there), a warning naming it: a
        run says at once that rows are skipped, and how many once the part has been read (`_say_missing`)."""
        if self._skipped_said:
            return
        self._skipped_said = True
        warnings.warn(f"{line}; such rows are skipped (how many is said once this process's part of the data has "
                      "been read)", GatedAttentionWarning, stacklevel=2)

    def _say_missing(self, position: dict | None) -> None:
        """At the end of the first part read to its end, a warning of how many JSON lines of it had no text
        field or a null one (skipped, as `datasets` reads them): said by rank 0 alone, of its own part where
        there are several (the others' lines are not parsed there), so that a run says it once."""
        if self._missing_said or not isinstance(position, dict) or "missing" not in position:
            return  # a position saved before the reader counted has no "missing": unknown, not said
        missing, null = position["missing"], position.get("null", 0)
        if not (missing or null):
            return
        self._missing_said = True
        part = "" if self.world == 1 else f" in rank 0's part (of {self.world})"
        warnings.warn(missing_field_notice(self.dataset.spec, self.text_field, missing, position["read"], part=part,
                                           null=null), GatedAttentionWarning, stacklevel=3)

    def _pieces(self, texts: list[str | Iterator[str]]) -> Iterator[np.ndarray]:
        for tokens in encode_documents(self.tokenizer, texts, self.piece_chars):
            self._read_in_epoch += len(tokens)
            yield tokens

    def _take(self, n: int) -> np.ndarray:
        out = []
        while n:
            if self._chunk is None and not self._read_chunk():
                if self._whole_epoch and not self._read_in_epoch:
                    raise DataError(f"{self.name}: no text to train on in this process's part of the data")
                self._start(self._epoch + 1, None, 0)
                continue
            tokens = self._chunk.take(n)
            if not len(tokens):  # the chunk is used up
                self._chunk = None
                continue
            out.append(tokens)
            n -= len(tokens)
        return np.concatenate(out)

    def next_rows(self, n: int) -> torch.Tensor:
        body = self.seq_len - 1
        rows = torch.from_numpy(self._take(n * body).astype(np.int64)).view(n, body)  # [n, T-1]
        bos = torch.full((n, 1), self.bos, dtype=torch.int64)
        return torch.cat([bos, rows], dim=1)  # [n, T]

    def epoch_tokens(self) -> Iterator[np.ndarray]:
        """The tokens of the documents from the next unread chunk to the end of this epoch, as consecutive
        arrays (documents joined by EOS, as the rows hold them): a new stream's whole part, for token shards."""
        while self._read_chunk():
            yield from self._chunk.pieces
        self._chunk = None

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_rows(1)[0]


def _dataset_chunks(dataset, field: str, rank: int, world: int, state: dict | None, size: int,
                    name: str) -> Iterator[tuple[object, dict]]:
    """(`field`'s pyarrow column, the `datasets` state after it) of each chunk of `size` documents of this
    process's part of `dataset` (a `datasets` IterableDataset), from `state` on."""
    from datasets.distributed import split_dataset_by_node

    if state is not None and "reader" in state:
        raise DataError(f"{name}: the saved stream position was written by this package's JSON-lines reader, and "
                        "this corpus is read by datasets'; resume from the same files")
    ds = split_dataset_by_node(dataset.select_columns([field]), rank=rank, world_size=world)
    ds = ds.with_format("arrow")  # tables, not Python objects: a long document is decoded a part at a time
    if state is not None:
        ds.load_state_dict(state)
    for batch in ds.iter(batch_size=size):
        yield batch.column(field), ds.state_dict()


def _documents(column, piece_chars: int) -> list[str | Iterator[str]] | None:
    """The non-empty documents of a pyarrow column of strings, in order; None for a column of another type.

    A document of more than `4 * piece_chars` bytes (more characters than one
    piece, whatever the characters) is not made one Python string: it is
    decoded from the column's buffer a part of that many bytes at a time
    (`_utf8_parts`), as `data.encode_documents` takes it. A 50 MB document
    would otherwise be held three times at once: the line's bytes and the
    parsed column (`datasets`), and a Python string of up to 4 bytes a
    character.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return None
    long_bytes, texts = 4 * piece_chars, []
    for chunk in column.chunks:
        sizes = pc.binary_length(chunk).fill_null(0).to_numpy(zero_copy_only=False)
        if sizes.max(initial=0) <= long_bytes:
            texts += [t for t in chunk.to_pylist() if t]
            continue
        for i in np.flatnonzero(sizes):
            value = chunk[int(i)]
            texts.append(_utf8_parts(value.as_buffer(), long_bytes) if sizes[i] > long_bytes else value.as_py())
    return texts


def _utf8_parts(buffer, size: int) -> Iterator[str]:
    """The text of UTF-8 `buffer` (valid, as pyarrow's strings are), decoded `size` bytes at a time and never
    inside a character."""
    data = memoryview(buffer)
    start = 0
    while start < len(data):
        end = min(start + size, len(data))
        while end < len(data) and data[end] & 0xC0 == 0x80:  # a continuation byte: the character goes on
            end -= 1
        yield str(data[start:end], "utf-8")
        start = end


def text_stream(spec, tokenizer, seq_len: int, *, text_field: str = "text", split: str | None = None,
                rank: int = 0, world: int = 1, chunk_docs: int = CHUNK_DOCS,
                piece_chars: int = PIECE_CHARS) -> PackedStream:
    """`PackedStream` of a `--dataset` spec (see `open_text_dataset`); checks the text field at once."""
    name = spec if isinstance(spec, str) else " ".join(spec)
    return PackedStream(open_corpus(spec, split), tokenizer, seq_len, text_field=text_field,
                        rank=rank, world=world, chunk_docs=chunk_docs, name=name, piece_chars=piece_chars)


def rows_digest(rows: torch.Tensor) -> int:
    """A 63-bit digest of some rows' tokens (for the batch digests of streamed steps)."""
    data = rows.to(torch.int64).contiguous().numpy().tobytes()
    return int.from_bytes(hashlib.sha1(data).digest()[:8], "big") >> 1


# ---------------------------------------------------------------------------------------------
# Token shards: tokenize once, then random access


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def write_token_shards(spec, tokenizer, out_dir, *, text_field: str = "text", split: str | None = None,
                       shard_tokens: int = 1 << 28, chunk_docs: int = CHUNK_DOCS) -> dict:
    """Tokenize a `--dataset` spec into `out_dir`: flat token files plus `index.json`; returns the index.

    The files hold the token stream (each document followed by EOS) as uint16
    when the vocabulary allows, else uint32, split every `shard_tokens` tokens.
    Everything is written to a sibling temporary folder that is renamed into
    place at the end, so `out_dir` is either complete or absent.
    """
    out_dir = Path(out_dir)
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be at least 1, got {shard_tokens}")
    if out_dir.exists():
        raise DataError(f"{out_dir} exists; token shards are written to a new folder")
    vocab = len(tokenizer)
    dtype = token_dtype(vocab)
    stream = PackedStream(open_corpus(spec, split), tokenizer, 2, text_field=text_field,
                          chunk_docs=chunk_docs, name=spec if isinstance(spec, str) else " ".join(spec))
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    with output_folder(out_dir.parent):
        tmp.mkdir()
        try:
            shards = _write_shards(stream, tmp, dtype, shard_tokens)
            index = {"format": _SHARDS_FORMAT, "dtype": np.dtype(dtype).name, "vocab_size": vocab,
                     "bos_token_id": stream.bos, "eos_token_id": stream.eos, "tokenizer": tokenizer.name_or_path,
                     "source": stream.name, "text_field": text_field, "split": split,
                     "tokens": sum(s["tokens"] for s in shards), "shards": shards}
            (tmp / INDEX).write_text(json.dumps(index, indent=1), encoding="utf-8")
            tmp.rename(out_dir)
        except BaseException:  # an error or Ctrl-C: no half-written folder stays behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return index


def _write_shards(stream: PackedStream, folder: Path, dtype, shard_tokens: int) -> list[dict]:
    """Read `stream`'s whole corpus once into token files of `shard_tokens` tokens; returns their index entries."""
    shards, current, written = [], None, 0
    try:
        for tokens in stream.epoch_tokens():
            tokens = tokens.astype(dtype)
            while len(tokens):
                if current is None or written == shard_tokens:
                    if current is not None:
                        current.close()
                        shards[-1]["tokens"] = written
                    shards.append({"file": f"tokens-{len(shards):05d}.bin", "tokens": 0})
                    current, written = open(folder / shards[-1]["file"], "wb"), 0
                k = min(len(tokens), shard_tokens - written)
                current.write(tokens[:k].tobytes())
                written, tokens = written + k, tokens[k:]
    finally:
        if current is not None:
            current.close()
    if not shards:
        raise DataError(f"{stream.name}: no text to tokenize")
    shards[-1]["tokens"] = written
    return shards


def is_token_shards(path) -> bool:
    return (Path(path) / INDEX).is_file()


class TokenShards:
    """Rows `[T]` of a `write_token_shards` folder by index, memory-mapped (nothing is read until asked).

    Row i is BOS followed by tokens `i*(T-1) .. (i+1)*(T-1)` of the whole token
    stream, the same rows `data.pack` would cut; the tail that does not fill a
    row is dropped. Indexing with a tensor or list of row indices gives `[N, T]`
    int64, so it stands in for an in-memory `[N, T]` tensor in `training.train`.
    """

    def __init__(self, folder, seq_len: int, tokenizer=None):
        folder = Path(folder)
        self.index = json.loads((folder / INDEX).read_text(encoding="utf-8"))
        if tokenizer is not None and (len(tokenizer), document_tokens(tokenizer)[1]) != (
                self.index["vocab_size"], self.index["eos_token_id"]):
            raise DataError(f"{folder}: tokenized with {self.index['tokenizer']} ({self.index['vocab_size']} tokens), "
                            f"not with this model's tokenizer ({len(tokenizer)} tokens)")
        dtype = np.dtype(self.index["dtype"])
        self.shards = [np.memmap(folder / s["file"], dtype=dtype, mode="r", shape=(s["tokens"],))
                       for s in self.index["shards"]]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])  # [S+1] stream offset of each shard
        self.seq_len, self.bos = seq_len, self.index["bos_token_id"]
        self.num_rows = int(self.starts[-1]) // (seq_len - 1)

    def __len__(self) -> int:
        return self.num_rows

    def _tokens(self, start: int, n: int) -> np.ndarray:
        out, end = [], start + n
        s = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < end:
            lo, hi = start - self.starts[s], min(end, self.starts[s + 1]) - self.starts[s]
            out.append(self.shards[s][lo:hi])
            start = self.starts[s] + hi
            s += 1
        return np.concatenate(out)

    def __getitem__(self, indices) -> torch.Tensor:
        if isinstance(indices, slice):
            indices = range(*indices.indices(self.num_rows))
        body = self.seq_len - 1
        rows = np.empty((len(indices), self.seq_len), dtype=np.int64)  # [N, T]
        rows[:, 0] = self.bos
        for j, i in enumerate(torch.as_tensor(indices).tolist()):
            if not 0 <= i < self.num_rows:
                raise IndexError(f"row {i} out of range ({self.num_rows} rows)")
            rows[j, 1:] = self._tokens(i * body, body)
        return torch.from_numpy(rows)
