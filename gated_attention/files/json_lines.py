"""JSON-lines files read a line at a time, and a very long line never whole.

`datasets`' json builder hands pyarrow a batch of lines at once, extended to
the end of its last line: a document of 50 MB in one line is read into one
`bytes`, parsed into a table (twice its size while parsing) and held while it
is used, so memory grows with the longest line. `JsonLinesCorpus` reads the
files itself. A line of up to `LONG_LINE` bytes is `json.loads`-ed; a longer
one is scanned in blocks of `BLOCK` bytes to find its fields, and the text
field's string is decoded `PART` bytes at a time, on demand, as
`training.data.encode_documents` takes a document given in parts. Whatever a
line's length, memory holds a block and a part.

`open_corpus` is what the training streams (`training.streaming.PackedStream`) and `analyze --dataset`
read: local JSON-lines files, given or in a folder (the files of the split `datasets` would read there),
through `JsonLinesCorpus`; saved datasets, other file kinds and Hub datasets stay `datasets`'
(`files.datasets.open_text_dataset`). The reading position is small JSON (file, byte offset, line, and
a digest of the bytes read before it), so a resume seeks straight to it, and reads on where those bytes are
unchanged: a corpus that grows by appends while a run trains resumes, an edit before the position is one
line naming the file.

Processes share the files as `datasets.distributed.split_dataset_by_node`
does: whole files when their number divides the world size, else every
world-th document.

A row is judged alone, as `datasets` infers a file's columns from all its rows:
a row without the text field, or with null there, is skipped (`check_corpus`
reads only up to the first row that has it, and names the keys of all rows
where none has), and the reader counts such rows as it goes, so that the
stream and `analyze` say how many in one line (`missing_field_notice`)
without reading a file twice; the stream names the first as it reads it.

A file whose tail is NUL bytes (space preallocated for a write that never
came, or a write cut short by a crash) is refused in one line naming the byte
where the NULs begin (`check_corpus`, and again whenever the file is opened
for reading): the bytes meant to stand there are lost, and a run that trained
on the rest without a word would hide it; the line tells how to cut the file
there. A file of nothing but NUL bytes, of any kind, is one line when it is
opened (`open_corpus`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from ..cli_common import first_line
from .datasets import BUILDERS, DataError, check_columns, check_has_text, check_text_field, open_text_dataset

LONG_LINE = 1 << 20  # a line longer than this many bytes is scanned in blocks, never read whole
BLOCK = 1 << 20  # bytes read at a time
PART = 1 << 18  # bytes of a long string decoded at a time (at most that many characters)
HASHED = 1 << 20  # bytes read at a time to hash what a position has read (`_Digests`)
READER = "json-lines"  # marks this reader's positions

_CONTAINER = re.compile(rb'["\[\]{}]')  # inside an array or object: a string, or a bracket
_SCALAR = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_WHITESPACE = b" \t\r"


class _BadLine(ValueError):
    """What is wrong with one line; `JsonLinesCorpus` adds the file and line number."""


class _Window:
    """Bytes `[start, end)` of a file (one line, its newline left out), read `BLOCK` bytes at a time."""

    def __init__(self, f, start: int, end: int):
        self.f, self.start, self.end = f, start, end
        self.base, self.buf = start, b""  # the bytes read last, from offset base

    def _cover(self, p: int, n: int) -> None:
        """Make the window hold bytes `[p, p + n)` (as many of them as the line has)."""
        if not (self.base <= p and min(p + n, self.end) <= self.base + len(self.buf)):
            self.f.seek(p)
            self.base, self.buf = p, self.f.read(min(max(n, BLOCK), self.end - p))

    def bytes(self, p: int, n: int) -> bytes:
        """Up to n bytes from offset p (fewer only at the line's end)."""
        self._cover(p, n)
        return self.buf[p - self.base : p - self.base + n]

    def at(self, p: int) -> int:
        """The byte at offset p (p < end)."""
        self._cover(p, 1)
        return self.buf[p - self.base]

    def skip_whitespace(self, p: int) -> int:
        while p < self.end and self.at(p) in _WHITESPACE:
            p += 1
        return p

    def expect(self, p: int, char: bytes) -> int:
        """The offset after `char`, which must be at p."""
        if p >= self.end or self.at(p) != char[0]:
            found = "the line's end" if p >= self.end else repr(chr(self.at(p)))
            raise _BadLine(f"expected {char.decode()!r} at byte {p - self.start}, found {found}")
        return p + 1

    def search(self, pattern: re.Pattern, p: int) -> int:
        """The offset of the first match of the one-byte `pattern` at or after p; `end` if none."""
        while p < self.end:
            self._cover(p, 1)
            match = pattern.search(self.buf, p - self.base)
            if match:
                return self.base + match.start()
            p = self.base + len(self.buf)
        return self.end

    def string_end(self, p: int) -> int:
        """The offset after the string that opens at p.

        A block at a time (each twice the last, up to `BLOCK`): its escaped
        backslashes and then its escaped quotes are replaced by two other bytes
        each (offsets unchanged), so its first quote left is the string's end. A
        block begins at a character or an escape: one that ends with an escape's
        backslash is followed from that backslash.
        """
        p, size = self.expect(p, b'"'), 256  # blocks from 256 bytes up: a short string is not a long copy
        while True:
            self._cover(p, 2)
            block = self.buf[p - self.base : p - self.base + size]
            plain = block.replace(b"\\\\", b"__").replace(b'\\"', b"__")
            q = plain.find(b'"')
            if q != -1:
                return p + q + 1
            if p + len(block) >= self.end:
                raise _BadLine("a string is not closed")
            p, size = p + len(block) - plain.endswith(b"\\"), min(2 * size, BLOCK)

    def value_end(self, p: int) -> int:
        """The offset after the JSON value that begins at p (a container's commas and colons unchecked)."""
        if p >= self.end:
            raise _BadLine("a value is missing")
        first = self.at(p)
        if first == ord('"'):
            return self.string_end(p)
        if first in b"[{":
            depth, p = 1, p + 1
            while depth:
                p = self.search(_CONTAINER, p)
                if p >= self.end:
                    raise _BadLine("an array or object is not closed")
                char = self.at(p)
                if char == ord('"'):
                    p = self.string_end(p)
                    continue
                depth += 1 if char in b"[{" else -1
                p += 1
            return p
        match = _SCALAR.match(self.bytes(p, 400))
        if not match:
            raise _BadLine(f"unexpected {chr(first)!r} at byte {p - self.start}")
        return p + match.end()

    def object_fields(self, field: str) -> tuple[list[str], tuple[int, int] | None]:
        """The keys of the object the line holds, and where `field`'s value is (its last one, as json.loads)."""
        p = self.expect(self.skip_whitespace(self.start), b"{")
        keys, where = [], None
        p = self.skip_whitespace(p)
        if p < self.end and self.at(p) == ord("}"):
            p += 1
        else:
            while True:
                key_end = self.string_end(p)
                if key_end - p > LONG_LINE:
                    raise _BadLine("a key is longer than 1 MB")
                key = json.loads(self.bytes(p, key_end - p))
                p = self.skip_whitespace(self.expect(self.skip_whitespace(key_end), b":"))
                value_end = self.value_end(p)
                keys.append(key)
                if key == field:
                    where = (p, value_end)
                p = self.skip_whitespace(value_end)
                if p < self.end and self.at(p) == ord(","):
                    p = self.skip_whitespace(p + 1)
                    continue
                p = self.expect(p, b"}")
                break
        if self.skip_whitespace(p) != self.end:
            raise _BadLine(f"more after the object, at byte {p - self.start}")
        return keys, where


def _escape_at(raw: bytes, q: int) -> int:
    """The length of the escape that begins at q in a JSON string's contents `raw` (which begins at a
    character or an escape), 0 if none begins there."""
    if raw[q : q + 1] != b"\\":
        return 0
    run = q
    while run > 0 and raw[run - 1] == ord("\\"):
        run -= 1
    if (q - run) % 2:  # the second of an escaped backslash
        return 0
    return 6 if raw[q + 1 : q + 2] == b"u" else 2


def _cut(raw: bytes, cut: int) -> int:
    """`cut` (at least 16) moved back, if need be, so that `raw[:cut]` (`raw` a JSON string's contents from a
    character or an escape on) ends neither inside an escape, nor inside a UTF-8 character, nor between
    the two escapes of a surrogate pair."""
    inside = next((q for q in range(cut - 5, cut) if q + _escape_at(raw, q) > cut), None)
    if inside is not None:
        cut = inside
    while raw[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte
        cut -= 1
    if _escape_at(raw, cut - 6) == 6 and raw[cut - 4 : cut - 2].lower() in (b"d8", b"d9", b"da", b"db"):
        cut -= 6  # a high surrogate: its low one follows
    return cut


def _string_parts(path: Path, start: int, end: int, where: str) -> Iterator[str]:
    """The JSON string at bytes `[start, end)` of `path` (its quotes included), decoded `PART` bytes at a
    time; `where` names the line for an error."""
    with open(path, "rb") as f:
        p, stop = start + 1, end - 1
        while p < stop:
            f.seek(p)
            raw = f.read(min(PART + 12, stop - p))
            if len(raw) < min(PART + 12, stop - p):
                raise DataError(f"{where} cannot be read (the file was cut short while it was read)")
            take = len(raw) if p + len(raw) == stop else _cut(raw, PART)
            try:
                yield json.loads(b'"' + raw[:take] + b'"')
            except ValueError as e:
                raise DataError(f"{where} cannot be read ({_reason(e, at=False)})") from None
            p += take


def _reason(error: Exception, at: bool = True) -> str:
    """A line's error in a few words: json's message with the character it names (`at`), or the error's
    first line."""
    if not isinstance(error, json.JSONDecodeError):
        return first_line(error)
    if not at:  # a part of a long string: its position is no help
        return error.msg
    return f"{error.msg}{'' if error.msg.endswith(' at') else ' at'} character {error.colno}"


class JsonLinesCorpus:
    """The documents of local JSON-lines files, one object per line, read without `datasets` (see the module
    docstring). `spec` names the corpus in errors, as `--dataset` gave it.

    A position is `{"reader": "json-lines", "file", "offset", "line", "document", "read", "missing", "null",
    "seen"}`: the next line to read (file index, byte offset, line number), how many documents came before it
    (for the every-world-th split), how many of them this process read and how many of those lacked the field
    asked or held null there (`chunks`), and what this process read of each file before the position (`_Digests`): a resume reads on
    where the bytes before the position are those the run read, so a corpus appended to since resumes, and an
    edit before the position is named rather than read from an offset that is no longer a line's start.
    """

    def __init__(self, files: list[str], spec: str):
        self.files, self.spec = [Path(f) for f in files], spec

    def start(self) -> dict:
        return {"reader": READER, "file": 0, "offset": 0, "line": 1, "document": 0, "read": 0, "missing": 0,
                "null": 0}

    def check_ends(self) -> None:
        """`DataError` for the first file whose tail is NUL bytes (see the module docstring), naming the byte
        offset where they begin; a file that does not end in NUL costs one byte read."""
        for path in self.files:
            with open(path, "rb") as f:
                _refuse_nul_tail(f, path, self.spec)

    def _check_unchanged(self, position: dict, digests: _Digests) -> None:
        """`DataError` naming the first file whose bytes before `position` are not those the run had read when
        it saved the position; `digests` is left at the position, to read on from."""
        if "seen" not in position:  # saved with each file's size instead, which must be the same now
            self._check_sizes(position.get("sizes"))
            return
        saved = position["seen"]
        if len(saved) != len(self.files):
            raise DataError(f"--dataset {self.spec}: the stream position was saved with {len(saved)} file(s), and "
                            f"{len(self.files)} are given; resume with the same files")
        for index, (then, now) in enumerate(zip(saved, digests.advance(position))):
            if then == now:
                continue
            path = self.files[index]
            named = "the file" if str(path) == self.spec else path
            (read, _), (found, _) = then, now
            if index < position["file"]:
                what = (f"{read:,} bytes then, {found:,} now" if read != found else "other bytes of the same length")
                why = f"{named} changed since the checkpoint, which had read all of it ({what})"
            elif found < read:
                why = f"{named} is shorter than the checkpoint's position in it ({read:,} bytes read then, {found:,} now)"
            else:
                why = f"{named} changed before the checkpoint's position in it (its first {read:,} bytes differ)"
            raise DataError(f"--dataset {self.spec}: {why}; resume with the data it was saved with, or start afresh")

    def _check_sizes(self, saved: list[int] | None) -> None:
        """`DataError` naming the first file whose size is not the one a position that kept sizes was saved with."""
        if saved is None:
            return
        if len(saved) != len(self.files):
            raise DataError(f"--dataset {self.spec}: the stream position was saved with {len(saved)} file(s), and "
                            f"{len(self.files)} are given; resume with the same files")
        for path, then in zip(self.files, saved):
            now = path.stat().st_size
            if then != now:
                named = "the file" if str(path) == self.spec else path
                raise DataError(f"--dataset {self.spec}: {named} changed since the checkpoint ({then:,} bytes then, "
                                f"{now:,} now); resume with the data it was saved with, or start afresh")

    # -- lines ------------------------------------------------------------------------------

    def _lines(self, position: dict,
               files: range | None = None) -> Iterator[tuple[int, int, int, int, bytes | None]]:
        """(file index, line number, start, end, the line's bytes or None for a long line) of each line
        that is not blank, from `position` on, in the `files` given (by index; all by default); `position`
        moves past each line as it is yielded."""
        for index in range(position["file"], len(self.files)):
            if files is not None and index not in files:
                position.update(file=index + 1, offset=0, line=1)
                continue
            resume = index == position["file"]
            offset, number = (position["offset"], position["line"]) if resume else (0, 1)
            with open(self.files[index], "rb") as f:
                _refuse_nul_tail(f, self.files[index], self.spec)
                if offset == 0 and f.read(3) == b"\xef\xbb\xbf":  # a UTF-8 byte-order mark
                    offset = 3
                f.seek(offset)
                buf, base, i = b"", offset, 0  # buf holds the file from offset base; the next line starts at i
                while True:
                    newline = buf.find(b"\n", i)
                    if newline == -1 and len(buf) - i <= LONG_LINE and (block := f.read(BLOCK)):
                        buf, base, i = buf[i:] + block, base + i, 0
                        continue
                    if newline != -1:
                        end, following = base + newline, base + newline + 1
                    elif i == len(buf):
                        break
                    elif len(buf) - i <= LONG_LINE:  # the last line, without a newline
                        end = following = base + len(buf)
                    else:  # a long line: find its end, not keeping it
                        end = base + len(buf)
                        while (block := f.read(BLOCK)) and (found := block.find(b"\n")) == -1:
                            end += len(block)
                        following = end + found + 1 if block else end
                        end += found if block else 0
                    position.update(file=index, offset=following, line=number + 1)
                    if end - base - i > LONG_LINE:
                        yield index, number, base + i, end, None
                    elif buf[i : end - base].strip():
                        yield index, number, base + i, end, buf[i : end - base]
                    number += 1
                    if following - base <= len(buf):
                        i = following - base
                    else:
                        f.seek(following)
                        buf, base, i = b"", following, 0
            position.update(file=index + 1, offset=0, line=1)

    def _where(self, index: int, number: int) -> str:
        """`--dataset SPEC: [FILE ]line N`, naming a line in a message."""
        path = self.files[index]
        return f"--dataset {self.spec}: {'' if str(path) == self.spec else f'{path} '}line {number}"

    def _value(self, index: int, number: int, start: int, end: int, line: bytes | None, field: str):
        """(the line's keys, its `field` value: a str, an iterator of a long string's parts, another JSON
        value, or None where the line has no such field)."""
        path, where = self.files[index], self._where(index, number)
        try:
            if line is not None:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise _BadLine(f"the line holds {type(record).__name__}, not an object")
                return list(record), record.get(field)
            with open(path, "rb") as f:
                window = _Window(f, start, end)
                keys, at = window.object_fields(field)
                if at is None:
                    return keys, None
                size = at[1] - at[0]
                if size <= LONG_LINE:
                    return keys, json.loads(window.bytes(at[0], size))
                if window.at(at[0]) != ord('"'):
                    raise _BadLine(f"its {field!r} value is {size:,} bytes of JSON, not a string")
            return keys, _string_parts(path, at[0], at[1], where)
        except (ValueError, UnicodeDecodeError) as e:  # _BadLine, json's JSONDecodeError
            raise DataError(f"{where} cannot be read ({_reason(e)})") from None

    def values(self, field: str) -> Iterator[tuple[list[str], object]]:
        """(keys, `field`'s value) of every line (see `_value`)."""
        for line in self._lines(self.start()):
            yield self._value(*line, field)

    def documents(self, fields: list[str]) -> Iterator[dict]:
        """`{field: value}` of every line for the `fields` asked (see `_value`: a long string comes as an
        iterator of its parts), as `datasets` gives a document's columns, less the fields the line does not
        have (`datasets` gives None for those too; left out, they can be told from a null)."""
        for line in self._lines(self.start()):
            document = {}
            for field in fields:
                keys, value = self._value(*line, field)
                if field in keys:
                    document[field] = value
            yield document

    # -- what the checks and the stream ask -------------------------------------------------------

    def columns(self, field: str | None = None, text: bool = False) -> list[str] | None:
        """The keys of all lines, in the order first met, as `datasets` infers columns from the whole file;
        None for files without a line. With `field`, reading stops at the first line that has it (with
        `text`: text in it), and the keys met up to there are returned: the whole file is read only where
        no line has what is asked."""
        seen: dict[str, None] = {}
        lines = 0
        for keys, value in self.values(field or ""):
            lines += 1
            seen.update(dict.fromkeys(keys))
            if field is not None and field in keys and (value or not text):
                break
        return list(seen) if lines else None

    def has_text(self, field: str) -> bool:
        """Whether some line has text in `field` (reads up to the first that has; a long one is not decoded)."""
        return any(value for _, value in self.values(field))

    def chunks(self, field: str, rank: int, world: int, position: dict | None, size: int,
               skipped: Callable[[str], None] | None = None) -> Iterator[tuple[list[object], dict]]:
        """This process's values of `field` (documents; None where a line has none) from `position` on,
        `size` lines at a time, each chunk with the position after it.

        The position also counts this process's lines since the part's start (`"read"`), those without
        `field` (`"missing"`) and those where it is null (`"null"`), so that the count at the part's end is true
        across a resume; a position saved before one was kept has none of it, and that count stays unknown.
        `skipped` is called with a line that has no text to train on, as it is read: `--dataset SPEC: line N
        has no 'text' field` (or `has a null 'text'`)."""
        position = dict(position) if position is not None else self.start()
        if position.get("reader") != READER:
            raise DataError(f"--dataset {self.spec}: the saved stream position was written by another reader "
                            "(datasets'); start the run afresh, or resume with the version that saved it")
        whole_files = len(self.files) % world == 0  # else every world-th document
        digests = _Digests(self.files, range(rank, len(self.files), world) if whole_files else range(len(self.files)))
        self._check_unchanged(position, digests)
        chunk = []
        for line in self._lines(position, range(rank, len(self.files), world) if whole_files else None):
            document = position["document"]
            position["document"] += 1
            if not whole_files and document % world != rank:
                continue
            keys, value = self._value(*line, field)
            empty = "has no {!r} field" if field not in keys else "has a null {!r}" if value is None else None
            if "missing" in position:
                position["read"] += 1
                position["missing"] += field not in keys
            if "null" in position:
                position["null"] += field in keys and value is None
            if empty and skipped is not None:
                skipped(f"{self._where(line[0], line[1])} {empty.format(field)}")
            chunk.append(value)
            if len(chunk) == size:
                yield chunk, dict(position, seen=digests.advance(position))
                chunk = []
        if chunk:
            yield chunk, dict(position, seen=digests.advance(position))


class _Digests:
    """What one process has read of each of its files up to a position: `[bytes, sha1 of those bytes]` of each
    file it has passed (all of it) and of the one it is in (up to the offset), None for the others.

    Kept with each position, so that a resume checks that the bytes before it are those the run read: lines
    appended to the file the position is in, or to a later one, lie after it and change none of these. The
    bytes are read again to hash them, once each, from the page cache where the reader has just read them.
    """

    def __init__(self, files: list[Path], mine: range):
        self.files, self.mine = files, mine
        self.seen: list[list | None] = [None] * len(files)
        self._open, self._hash = None, None  # the file being hashed (the position's), and its sha1 so far

    def advance(self, position: dict) -> list[list | None]:
        """The digests up to `position` (at or after the last position asked), as JSON."""
        for index in self.mine:
            if index > position["file"]:
                break
            if self.seen[index] is not None and index != self._open:
                continue  # passed whole already
            if index != self._open:
                self._open, self._hash, self.seen[index] = index, hashlib.sha1(), [0, ""]
            whole = index < position["file"]
            read = self.seen[index][0]
            with open(self.files[index], "rb") as f:
                f.seek(read)
                while block := f.read(HASHED if whole else min(HASHED, position["offset"] - read)):
                    self._hash.update(block)
                    read += len(block)
            self.seen[index] = [read, self._hash.hexdigest()]
            if whole:
                self._open = None
        return [None if entry is None else list(entry) for entry in self.seen]


def _refuse_nul_tail(f, path: Path, spec: str) -> None:
    """`DataError` if the open file `f` ends in NUL bytes, naming the offset where they begin (found from
    the end, `BLOCK` bytes at a time: a preallocated tail may be gigabytes). JSON holds no raw NUL, so a
    NUL is never a line's own last byte."""
    size = f.seek(0, 2)
    if not size:
        return
    f.seek(size - 1)
    if f.read(1) != b"\0":
        return
    start = size
    while start:
        f.seek(max(0, start - BLOCK))
        block = f.read(start - max(0, start - BLOCK))
        kept = len(block.rstrip(b"\0"))
        start -= len(block) - kept
        if kept:
            break
    raise DataError(f"--dataset {spec}: {path} ends in {size - start:,} NUL bytes from byte {start:,} on (space "
                    "preallocated for a write that never came, or a write cut short); cut it there to read the "
                    f"rest (truncate -s {start} {path})")


def _refuse_all_nul(path: Path, spec: str) -> None:
    """`DataError` for a file of nothing but NUL bytes (space preallocated for a write that never came), which no
    reader would name for what it is; a file that does not begin with NUL costs one byte read."""
    with open(path, "rb") as f:
        if f.read(1) != b"\0":
            return
        f.seek(0)
        while block := f.read(BLOCK):
            if block.strip(b"\0"):
                return
    raise DataError(f"--dataset {spec}: {path} holds nothing but NUL bytes ({path.stat().st_size:,} of them: space "
                    "preallocated for a write that never came, or a write cut short); there is nothing to read")


def missing_field_notice(spec: str, field: str, missing: int, read: int, whole: bool = True,
                         part: str = "", null: int = 0) -> str:
    """The one line that says how many rows had no `field`, or a null one, and were skipped: of the `read` rows of
    `spec` (`whole`: all its rows; else only those read, which `part` may name)."""
    if not null:
        count, which = missing, f"have no {field!r} field"
    elif not missing:
        count, which = null, f"have a null {field!r}"
    else:
        count, which = missing, f"have no {field!r} field and {null:,} a null one"
    return f"--dataset {spec}: {count:,} of {read:,} rows{'' if whole else ' read'}{part} {which}; skipped"


def is_json_lines(path: Path) -> bool:
    """Whether a .jsonl or .json file holds JSON lines: its first line one JSON object (or longer than
    `LONG_LINE`, too long to be the first line of one object written over several lines). A JSON array, or
    one object over several lines, is not (datasets' json builder reads those)."""
    if path.suffix.lower() not in (".jsonl", ".json"):
        return False
    with open(path, "rb") as f:
        head = f.read(LONG_LINE + 1)
    head = head.removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")
    if not head.startswith(b"{"):
        return False
    newline = head.find(b"\n")
    if newline == -1 and len(head) > LONG_LINE:
        return True  # a first line longer than this read: an object of its own
    try:
        return isinstance(json.loads(head[:newline] if newline != -1 else head), dict)
    except ValueError:
        return False


def _split_files(folder: Path, split: str | None, spec: str) -> list[Path] | None:
    """The JSON-lines files of `split` (None: train) in `folder`, as `datasets` picks a split's files from their
    names (train*.jsonl, data/validation-*.jsonl, or every file for train); None where `datasets` should read
    the folder: a `save_to_disk` folder, no such split, a file of another kind or one that is no JSON lines.
    One of nothing but NUL bytes is refused (`spec` names the folder as given)."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    if (folder / "state.json").exists() or (folder / "dataset_dict.json").exists():
        return None
    kinds = {BUILDERS.get(f.suffix.lower()) for f in folder.rglob("*")
             if f.is_file() and not any(part.startswith(".") for part in f.relative_to(folder).parts)}
    if kinds - {None} != {"json"}:  # mixed kinds, or none: datasets' reader refuses them in one line
        return None
    try:
        splits = DataFilesDict.from_patterns(get_data_patterns(str(folder)), base_path=str(folder))
    except Exception:  # noqa: BLE001 - datasets says what is wrong when it opens the folder
        return None
    files = [Path(f) for f in splits.get(split or "train", []) if Path(f).suffix.lower() in (".jsonl", ".json")]
    if not files:
        return None
    for f in files:
        _refuse_all_nul(f, spec)
    return files if all(f.stat().st_size and is_json_lines(f) for f in files) else None


def open_corpus(spec: str | list[str], split: str | None = None):
    """A corpus to read: local JSON-lines files, or a folder of them, as a `JsonLinesCorpus` (a line of any
    length in bounded memory), anything else as `files.datasets.open_text_dataset` opens it. A file given of
    nothing but NUL bytes is one line saying so, whatever its kind (no reader says what it is)."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    paths = [Path(s).expanduser() for s in specs]
    for path in paths:
        if path.is_file():
            _refuse_all_nul(path, " ".join(specs))
    if len(paths) == 1 and paths[0].is_dir():
        files = _split_files(paths[0], split, specs[0])
        if files is not None:
            return JsonLinesCorpus([str(f) for f in files], specs[0])
    elif all(p.is_file() and p.stat().st_size and is_json_lines(p) for p in paths):
        return JsonLinesCorpus([str(p) for p in paths], " ".join(specs))
    return open_text_dataset(spec, split)


def check_corpus(corpus, text_field: str, spec: str, *, has_text: bool = True, flag: str = "--text-field") -> None:
    """`DataError` unless `text_field` is a column of an `open_corpus` corpus (for JSON lines: a key of some
    line, read up to the first that has it; the error names the keys of all lines) and, with `has_text`,
    some document has text in it (read up to the first that has); `flag` names the option that gave the
    column. JSON-lines files whose tail is NUL bytes are refused (`JsonLinesCorpus.check_ends`)."""
    if not isinstance(corpus, JsonLinesCorpus):
        check_text_field(corpus, text_field, spec, flag)
        if has_text:
            check_has_text(corpus, text_field, spec)
        return
    corpus.check_ends()
    columns = corpus.columns(text_field, text=has_text)
    check_columns(columns, text_field, spec, flag)
    if has_text and not corpus.has_text(text_field):  # a line has the field: the first with text was sought
        raise DataError(f"--dataset {spec}: no document has text in its {text_field!r} column")
