"""Analysis inputs: text that ships with Python (the default), a text file, or datasets.

Built-in samples: nothing is downloaded. prose = the documentation topics of `pydoc_data.topics`;
code = source of a fixed list of small standard-library modules (from their
first `def`/`class` on, past licence headers); math = docstrings of
`statistics`, `fractions` and `math` (formulas, numbers, doctest arithmetic).
The choice and order are fixed, so two runs on one Python analyse the same text.

Datasets (`dataset_samples`): what `--dataset` reads in the training examples (`files.json_lines.open_corpus`:
JSON lines through the package's reader, the rest through `datasets`), streamed, the first documents with
text of each domain. A domain is one `--dataset`, or each value of a domain column, as the hybrid paper
takes 100 inputs from each of its five corpora. A text is read only as far as `max_chars`: a document of
one 200 MB line costs what its first characters cost. JSON-lines rows without the text field are skipped,
and a warning says how many of the rows read (`files.json_lines.missing_field_notice`), once per dataset.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .. import GatedAttentionWarning
from ..files.datasets import DataError, reading
from ..files.json_lines import JsonLinesCorpus, check_corpus, missing_field_notice, open_corpus

_CODE_MODULES = ("bisect", "heapq", "textwrap", "fnmatch", "colorsys", "shlex", "calendar", "graphlib", "queue", "glob")
_MATH_MODULES = ("statistics", "fractions", "math", "cmath")


@dataclass(frozen=True)
class Sample:
    domain: str
    source: str  # where the text comes from, e.g. "pydoc_data.topics:assert"
    text: str


def _spread(items: list, n: int) -> list:
    """n items evenly spaced over the list, first and last included (all of them if n >= len)."""
    if n >= len(items):
        return list(items)
    if n <= 1:
        return items[:n]
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def _prose(n: int, max_chars: int) -> list[Sample]:
    from pydoc_data.topics import topics

    names = [k for k in sorted(topics) if len(topics[k]) >= 1000]
    return [Sample("prose", f"pydoc_data.topics:{k}", topics[k][:max_chars]) for k in _spread(names, n)]


def _code(n: int, max_chars: int) -> list[Sample]:
    import importlib

    out = []
    for name in _CODE_MODULES:
        if len(out) == n:
            break
        try:
            source = inspect.getsource(importlib.import_module(name))
        except (ImportError, OSError, TypeError):  # frozen or source-less installs
            continue
        start = re.search(r"^(def|class) ", source, flags=re.M)
        out.append(Sample("code", f"{name}.py", source[start.start() if start else 0 :][:max_chars]))
    return out


def _math(n: int, max_chars: int) -> list[Sample]:
    import importlib

    docs = []
    for name in _MATH_MODULES:
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or not callable(obj) or getattr(obj, "__module__", name) != name:
                continue  # private, a constant, or imported from elsewhere
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80 and any(c.isdigit() for c in doc):
                docs.append((f"{name}.{attr}", doc))
    chunks, text, sources = [], "", []
    for source, doc in docs:
        text += doc + "\n\n"
        sources.append(source)
        if len(text) >= max_chars:
            chunks.append(Sample("math", f"{sources[0]}..{sources[-1]}", text[:max_chars]))
            text, sources = "", []
    return _spread(chunks, n)  # across the modules rather than the first n chunks


def builtin_samples(n_per_domain: int = 4, max_chars: int = 2000) -> list[Sample]:
    """`n_per_domain` samples of each of prose, code and math, each at most `max_chars` characters."""
    return _prose(n_per_domain, max_chars) + _code(n_per_domain, max_chars) + _math(n_per_domain, max_chars)


def read_text_file(path: str | Path) -> list[Sample]:
    """One sample per blank-line-separated paragraph of a UTF-8 text file."""
    text = Path(path).read_text(encoding="utf-8")
    paragraphs = [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]
    return [Sample("text-file", f"{Path(path).name}:{i}", p) for i, p in enumerate(paragraphs)]


def _head(value, max_chars: int | None):
    """A document's text cut to `max_chars` (None: whole); a long JSON-lines string comes as an iterator of its
    parts (`JsonLinesCorpus`), read only as far as needed. Anything else is returned as it is."""
    if isinstance(value, str):
        return value if max_chars is None else value[:max_chars]
    if value is None or isinstance(value, (int, float, bool, list, dict)):
        return value
    text, size = [], 0
    for part in value:
        text.append(part)
        size += len(part)
        if max_chars is not None and size >= max_chars:
            break
    return "".join(text)[:max_chars]


@dataclass(frozen=True)
class DatasetSpec:
    """One `--dataset`: its files, folder or Hub id (as the training examples take it) and its text column."""

    spec: tuple[str, ...]
    text_field: str = "text"

    @property
    def name(self) -> str:
        return " ".join(self.spec)


def dataset_samples(
    datasets: Sequence[DatasetSpec],
    n_per_domain: int,
    *,
    domain_field: str | None = None,
    split: str | None = None,
    max_chars: int | None = None,
    progress=None,
) -> list[Sample]:
    """The first `n_per_domain` documents with text of each domain, in reading order.

    Without `domain_field` each dataset is one domain, named after it, and reading stops at its
    `n_per_domain`-th document. With it, each value of that column is a domain and every dataset is
    read to its end (a new domain may come last). `max_chars` cuts each text (None: whole).
    Raises `DataError` (one line naming the dataset) for input that cannot be read, also when the
    failure surfaces while reading (a truncated JSON line, a file that is not JSON), for a document
    without a domain, and for a dataset given twice with one text field (one domain twice). Given
    with two text fields, each is a domain: `name [field]`.
    """
    samples: list[Sample] = []
    fields: dict[tuple[str, ...], list[str]] = {}
    for d in datasets:
        if d.text_field in fields.setdefault(d.spec, []):
            raise DataError(f"--dataset {d.name} is given twice with --text-field {d.text_field!r}: the same "
                            "documents as two domains; give it once")
        fields[d.spec].append(d.text_field)
    for d in datasets:
        name = d.name if len(fields[d.spec]) == 1 else f"{d.name} [{d.text_field}]"
        ds = open_corpus(d.spec[0] if len(d.spec) == 1 else list(d.spec), split)
        with reading(d.spec):  # a streamed file fails while its documents are read: one line naming it
            check_corpus(ds, d.text_field, name, has_text=False)
            if domain_field is not None:
                check_corpus(ds, domain_field, name, has_text=False, flag="--domain-field")
            if isinstance(ds, JsonLinesCorpus):
                ds = ds.documents([d.text_field] + ([domain_field] if domain_field is not None else []))
            taken: dict[str, int] = {}
            missing, read, whole = 0, 0, True  # rows without the text field (JSON lines leave it out), of those read
            for i, doc in enumerate(ds):
                if progress is not None:
                    progress()
                read += 1
                missing += d.text_field not in doc
                text = _head(doc.get(d.text_field), max_chars)
                if not isinstance(text, str) or not text.strip():
                    continue
                domain = name if domain_field is None else doc.get(domain_field)
                if domain is None:  # "None" would be a domain of its own
                    raise DataError(f"--dataset {name}: document {i} has no {domain_field!r} value (null), and "
                                    "--domain-field takes each document's domain from it")
                domain = str(domain)
                if taken.get(domain, 0) >= n_per_domain:
                    continue
                taken[domain] = taken.get(domain, 0) + 1
                samples.append(Sample(domain, f"{name}:{i}", text))
                if domain_field is None and taken[domain] >= n_per_domain:
                    whole = False  # the rows after it are not read: the count is of those read
                    break
        if not taken:
            raise DataError(f"--dataset {name}: no document has text in its {d.text_field!r} column")
        if missing:
            warnings.warn(missing_field_notice(name, d.text_field, missing, read, whole), GatedAttentionWarning,
                          stacklevel=2)
    return samples
