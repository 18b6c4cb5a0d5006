"""Opening a text corpus as a stream: local files, a `save_to_disk` folder or a cached Hub dataset.

`open_text_dataset` is what every `--dataset` flag reads (the training examples, `analyze`):
txt, jsonl/json, parquet and csv files (one kind at a time), a folder of them, a folder
written by `datasets`' `save_to_disk`, or a Hub dataset id read from huggingface_hub's
cache. It always returns a streaming `IterableDataset`, so nothing is loaded whole.
Every failure is a `DataError` whose message is one line for the user.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from ..cli_common import first_line
from ..hub.repo_ids import HubUnavailable, cached_or_downloaded

# file suffix -> `datasets` packaged builder
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    """A corpus that cannot be read as asked; the message is one line meant for the user."""


class _QuotedFiles(logging.Handler):
    """Keeps the first quoted name of each error record: `datasets`' builders log "Failed to read file '...'"."""

    QUOTED = re.compile(r"'([^']+)'")

    def __init__(self):
        super().__init__(logging.ERROR)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = self.QUOTED.search(record.getMessage())
        if match:
            self.names.append(match.group(1))


class reading:  # noqa: N801 - used as `with reading(spec):`, like a function
    """Inside the block, any failure of `datasets` or pyarrow to read the corpus `spec` is a `DataError`
    naming the file.

    A streamed file is read while its documents are iterated, not when it is
    opened, so every place that reads documents reads them inside this block.
    The exceptions (pyarrow's `ArrowInvalid`, a `StopIteration` for an empty
    file, ...) name no file; `datasets`' builders log it instead, as an error
    ("Failed to read file '...'"). Those records are taken here rather than
    printed, and the file they name goes into the one line.
    """

    _BUILDERS = "datasets.packaged_modules"  # the loggers of datasets' json, csv, parquet, text, arrow builders

    def __init__(self, spec):
        self.spec = spec if isinstance(spec, str) else " ".join(spec)
        self._files = _QuotedFiles()

    def __enter__(self) -> reading:
        self._logger = logging.getLogger(self._BUILDERS)
        self._propagate, self._logger.propagate = self._logger.propagate, False
        self._logger.addHandler(self._files)
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        self._logger.removeHandler(self._files)
        self._logger.propagate = self._propagate
        if error is None or isinstance(error, DataError) or not isinstance(error, Exception):
            return False  # Ctrl-C and the like pass
        where, files = "", self._files.names
        if files and Path(files[0]).resolve() != Path(self.spec).expanduser().resolve():
            where = f"{files[0]} "
        if isinstance(error, StopIteration):  # datasets' builders read the first file on opening
            raise DataError(f"--dataset {self.spec}: {where}holds no documents") from error
        raise DataError(f"--dataset {self.spec}: {where}cannot be read ({first_line(error)})") from error


# datasets' json builder reads a file in batches of this many bytes, each extended to the end of its last line
JSON_CHUNK = 10 << 20


def _long_first_batch(files: list[str]) -> bool:
    """Whether the json builder's first batch of some file runs far past `JSON_CHUNK`: the line that crosses
    the chunk's end goes on for another chunk or more (a document of tens of MB in one line)."""
    for file in files:
        with open(file, "rb") as f:
            f.seek(JSON_CHUNK)
            left = JSON_CHUNK
            while left:
                block = f.read(min(left, 1 << 20))
                if not block or b"\n" in block:
                    break
                left -= len(block)
            else:
                return True
    return False


def _load_streaming(builder: str, spec: str, files: list[str], **kwargs):
    """`datasets.load_dataset(builder, streaming=True, **kwargs)` of the corpus files `files`, its read errors
    as `DataError`s (`reading`).

    A .txt file is one document, as with `--text-files` (the text builder would make every line one).

    A JSON-lines file whose first batch holds a very long line is opened without `on_mixed_types`. With it
    (datasets' default), datasets parses a file's first batch twice when it opens it: into Python objects,
    to find fields whose keys or type change from line to line (which it then stores as JSON text), kept
    while pyarrow parses the same bytes: a file of one long line is held that many more times while it opens
    (`benchmarks/long_document.py` measures it). Without it, such fields in that first batch are
    pyarrow's to read; where pyarrow cannot (a type that changes), the dataset has no columns after opening
    and is opened again with datasets' default. The one difference left: a field whose keys vary within the
    first batch becomes a struct of those keys, not JSON text, so a later line with yet another key fails
    to read where datasets' default reads it. A type that changes after the first batch fails either way.
    """
    from datasets import load_dataset

    extra = {"sample_by": "document"} if builder == "text" else {}
    with reading(spec):  # builders read the first file already, to learn its columns
        if builder == "json" and _long_first_batch(files):
            import pyarrow as pa

            ds = load_dataset(builder, streaming=True, on_mixed_types=None, **kwargs)
            pa.default_memory_pool().release_unused()  # what pyarrow parsed to learn the columns: not kept
            if ds.features is not None:
                return ds
        return load_dataset(builder, streaming=True, **extra, **kwargs)


def _data_files(folder: Path) -> dict[str, list[str]]:
    """The corpus files under `folder` (hidden ones skipped), grouped by builder."""
    found: dict[str, list[str]] = {}
    for f in sorted(folder.rglob("*")):
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(folder).parts):
            builder = BUILDERS.get(f.suffix.lower())
            if builder:
                found.setdefault(builder, []).append(str(f))
    return found


def _from_files(files: list[str], builder: str, spec: str):
    return _load_streaming(builder, spec, files, data_files=files, split="train")


def _from_folder(folder: Path, split: str, spec: str):
    from datasets import load_from_disk

    if (folder / "state.json").exists() or (folder / "dataset_dict.json").exists():  # save_to_disk
        with reading(spec):
            ds = load_from_disk(str(folder))
        if hasattr(ds, "keys"):  # a DatasetDict
            split = split or "train"
            if split not in ds:
                raise DataError(f"--dataset {spec}: no split {split!r} (it has {', '.join(ds.keys())})")
            ds = ds[split]
        elif split is not None and str(ds.split) != split:  # one saved split, or a dataset without any
            saved = f"one split, {str(ds.split)!r}" if ds.split is not None else "a dataset without splits"
            raise DataError(f"--dataset {spec}: --split {split!r} names no split of it: it was saved as {saved}; "
                            "leave --split out to read it")
        return ds.to_iterable_dataset()
    found = _data_files(folder)
    if not found:
        raise DataError(f"--dataset {spec}: no {'/'.join(sorted(BUILDERS))} files in {folder}")
    if len(found) > 1:
        raise DataError(f"--dataset {spec}: mixed file kinds ({', '.join(sorted(found))}); give one kind")
    (builder,) = found
    try:  # datasets picks the split from file names (train*.jsonl, data/validation-*.parquet, ...)
        return _load_streaming(builder, spec, found[builder], data_dir=str(folder), split=split or "train")
    except DataError as e:
        if not isinstance(e.__cause__, ValueError) or type(e.__cause__).__module__.startswith("pyarrow"):
            raise
        raise DataError(f"--dataset {spec}: {first_line(e.__cause__)}") from None


def _cached_hub_dataset(repo_id: str) -> Path:
    """A Hub dataset repo's files from huggingface_hub's cache (downloaded only when not offline)."""
    try:
        return cached_or_downloaded(repo_id, repo_type="dataset")
    except HubUnavailable as e:
        raise DataError(f"--dataset {repo_id}: no such file or folder, and {e}") from None


def open_text_dataset(spec: str | list[str], split: str | None = None):
    """A streaming `datasets.IterableDataset` of documents, not yet split across processes.

    `spec` is one or more files (`BUILDERS` suffixes, one kind), a folder of such
    files, a folder written by `save_to_disk`, or a Hub dataset id (`owner/name`,
    read from the local cache when there, so offline once cached). `split`: of a
    folder, saved `DatasetDict` or Hub id (None: "train"); a dataset saved alone
    is read when `split` is None or the split it was saved from. Raises
    `DataError` with a one-line message when it cannot.
    """
    specs = [spec] if isinstance(spec, str) else list(spec)
    paths = [Path(s).expanduser() for s in specs]
    if len(paths) == 1 and paths[0].is_dir():
        return _from_folder(paths[0], split, specs[0])
    if all(p.is_file() for p in paths):
        kinds = {BUILDERS.get(p.suffix.lower()) for p in paths}
        if None in kinds:
            bad = next(s for s, p in zip(specs, paths) if p.suffix.lower() not in BUILDERS)
            raise DataError(f"--dataset {bad}: unknown file kind (expected {', '.join(sorted(BUILDERS))})")
        if len(kinds) > 1:
            raise DataError(f"--dataset: mixed file kinds ({', '.join(sorted(kinds))}); give one kind")
        empty = next((s for s, p in zip(specs, paths) if p.stat().st_size == 0), None)
        if empty is not None:
            raise DataError(f"--dataset {empty}: the file is empty")
        return _from_files([str(p) for p in paths], kinds.pop(), " ".join(specs))
    missing = next(s for s, p in zip(specs, paths) if not p.exists())
    if len(specs) == 1 and "/" in missing and not missing.startswith((".", "/", "~")) and missing.count("/") == 1:
        return _from_folder(_cached_hub_dataset(missing), split, missing)
    raise DataError(f"--dataset {missing}: no such file or folder")


def check_text_field(ds, text_field: str, spec, flag: str = "--text-field") -> None:
    """`DataError` unless `text_field` is a column of `ds` (known from its features or first document);
    `flag` names the option that gave the column."""
    columns = ds.column_names
    if columns is None:  # features unknown until read: look at the first document
        with reading(spec):
            first = next(iter(ds.take(1)), None)
        columns = None if first is None else list(first)
    check_columns(columns, text_field, spec, flag)


def check_columns(columns: list[str] | None, text_field: str, spec, flag: str = "--text-field") -> None:
    """`DataError` unless `text_field` is in `columns` (None: a corpus without documents)."""
    if columns is None:
        raise DataError(f"--dataset {spec}: the dataset is empty")
    if text_field not in columns:
        raise DataError(f"{flag} {text_field!r}: {spec} has no such column (its columns: {', '.join(columns)})")


def check_has_text(ds, text_field: str, spec) -> None:
    """`DataError` unless some document of `ds` has text in `text_field` (reads up to the first that has)."""
    with reading(spec):
        for doc in ds.select_columns([text_field]):
            if doc[text_field]:
                return
    raise DataError(f"--dataset {spec}: no document has text in its {text_field!r} column")
