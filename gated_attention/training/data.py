"""Embedded training data: text that ships with Python, a BPE tokenizer trained on it, packing.

The corpus needs nothing downloaded: the documentation topics of
`pydoc_data.topics` (English prose about Python) and the source files of the
standard library's top-level modules (code with docstrings). Each topic or file
is one document. Documents are ordered by a hash of their name (which mixes
prose and code, so any prefix of the order is a fair sample) and split by the
same hash: one document in ten goes to validation. Both are fixed for a given
Python installation; `corpus_fingerprint` names the exact text.

The tokenizer is byte-level BPE (any text encodes, nothing is unknown), trained
with `tokenizers` the first time it is asked for and cached under
`cache_dir()`, as a normal `tokenizer.json` + `tokenizer_config.json` that
`AutoTokenizer.from_pretrained` loads. It prepends `<|bos|>` when called with
`add_special_tokens=True`, as the models were trained.

Packing (`pack`) cuts the token stream (documents joined by `<|eos|>`) into
fixed-length rows that each start with `<|bos|>`: real pretraining data starts
every sequence with the same token, and that consistent first token is where
attention sinks form.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import sysconfig
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2: the defaults of GatedAttentionConfig / LlamaConfig
VALIDATION_EVERY = 10  # one document in ten (by name hash) is validation
_TOKENIZER_FORMAT = 1  # bump when the tokenizer recipe changes, so old caches are not reused


def cache_dir() -> Path:
    """`$GATED_ATTENTION_CACHE`, else `$XDG_CACHE_HOME/gated-attention` (default `~/.cache/gated-attention`)."""
    if os.environ.get("GATED_ATTENTION_CACHE"):
        return Path(os.environ["GATED_ATTENTION_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "gated-attention"


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.sha1(name.encode("utf-8")).digest()[:8], "big")


def _pydoc_topics() -> list[Document]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions ship Python without pydoc_data
        return []
    return [Document(f"pydoc:{key}", text) for key, text in topics.items()]


def _stdlib_sources() -> list[Document]:
    folder = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(folder.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            docs.append(Document(f"stdlib:{path.name}", text))
    return docs


def corpus_documents() -> list[Document]:
    """Every document of the embedded corpus, in the fixed (name-hash) order."""
    docs = _pydoc_topics() + _stdlib_sources()
    if not docs:
        raise RuntimeError("no embedded corpus: this Python has neither pydoc_data nor standard-library sources")
    return sorted(docs, key=lambda d: (_name_hash(d.name), d.name))


def _first_chars(docs: Sequence[Document], max_chars: int | None) -> list[Document]:
    """The leading documents up to `max_chars` characters in all (always at least one); all of them for None."""
    if max_chars is None:
        return list(docs)
    out, total = [], 0
    for d in docs:
        if out and total + len(d.text) > max_chars:
            break
        out.append(d)
        total += len(d.text)
    return out


def corpus_split(split: str, max_chars: int | None = None) -> list[Document]:
    """The `"train"` or `"validation"` documents, optionally only a prefix of about `max_chars` characters.

    The prefix keeps whole documents and always at least one.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    want_val = split == "validation"
    docs = [d for d in corpus_documents() if (_name_hash(d.name) % VALIDATION_EVERY == 0) == want_val]
    return _first_chars(docs, max_chars)


# ---------------------------------------------------------------------------------------------
# The larger on-machine corpus: the Python sources of the project's own dependencies


# Fixed, not "whatever is installed": these are the packages this project needs
# (pyproject's dependencies, by import name), so every machine that runs it has them.
# Their versions still differ between machines; `package_corpus_manifest` records them
# and `corpus_fingerprint` names the exact text, so a run says which corpus it used.
PACKAGE_CORPUS_PACKAGES = (
    "accelerate", "fla", "huggingface_hub", "matplotlib", "numpy", "peft", "safetensors", "tokenizers", "torch",
    "transformers", "triton",
)
PACKAGE_CORPUS_CHARS = 48_000_000  # default cap: about 15M tokens with the 1024-token embedded BPE
_SKIP_PARTS = {"__pycache__", "site-packages", "dist-packages", "test", "tests", "idlelib"}


def _package_folder(name: str) -> Path | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(sorted(spec.submodule_search_locations)[0])


def _python_files(folder: Path, prefix: str) -> list[Document]:
    """Every `*.py` under `folder` (test folders and caches left out), named `prefix` + relative path.

    Names use the path relative to `folder`, so they do not depend on where Python is installed.
    """
    docs = []
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder)
        if _SKIP_PARTS & set(rel.parts[:-1]):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            docs.append(Document(prefix + rel.as_posix(), text))
    return docs


@functools.lru_cache(maxsize=1)  # ~130 MB of text read once per process: the split and the token cache both ask
def _all_package_documents() -> tuple[Document, ...]:
    docs = _pydoc_topics() + _python_files(Path(sysconfig.get_paths()["stdlib"]), "stdlib:")
    for name in PACKAGE_CORPUS_PACKAGES:
        folder = _package_folder(name)
        if folder is not None:
            docs += _python_files(folder, f"pkg:{name}/")
    return tuple(sorted(docs, key=lambda d: (_name_hash(d.name), d.name)))


def package_corpus_documents(max_chars: int | None = PACKAGE_CORPUS_CHARS) -> list[Document]:
    """The package corpus, in the fixed (name-hash) order, cut after about `max_chars` characters.

    The embedded corpus (pydoc topics, top-level standard-library modules, with
    the same names, so the same split) plus the standard library's packages
    (`stdlib:json/decoder.py`, tests left out) plus the sources of
    `PACKAGE_CORPUS_PACKAGES` (`pkg:torch/nn/modules/linear.py`). The cut keeps
    whole documents in hash order, so it is a fair sample of all of them.
    """
    return _first_chars(_all_package_documents(), max_chars)


def package_corpus_manifest() -> dict:
    """Which packages (and versions) the package corpus was read from on this machine."""
    from importlib import metadata

    versions = {}
    for name in PACKAGE_CORPUS_PACKAGES:
        dist = {"fla": "flash-linear-attention", "huggingface_hub": "huggingface-hub"}.get(name, name)
        try:
            versions[name] = metadata.version(dist) if _package_folder(name) else None
        except metadata.PackageNotFoundError:
            versions[name] = "unknown"
    return {"python": sysconfig.get_python_version(), "packages": versions}


CORPORA = ("embedded", "packages")


def documents(corpus: str, split: str, max_chars: int | None = None) -> list[Document]:
    """The `split` of `corpus`: `"embedded"` (`corpus_split`) or `"packages"` (`package_corpus_documents`).

    For `"packages"`, `max_chars` caps the whole corpus before the split
    (None = `PACKAGE_CORPUS_CHARS`); both corpora split one document in ten
    to validation by the same name hash.
    """
    if corpus == "embedded":
        return corpus_split(split, max_chars)
    if corpus != "packages":
        raise ValueError(f"corpus must be one of {CORPORA}, got {corpus!r}")
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    want_val = split == "validation"
    docs = package_corpus_documents(PACKAGE_CORPUS_CHARS if max_chars is None else max_chars)
    return [d for d in docs if (_name_hash(d.name) % VALIDATION_EVERY == 0) == want_val]


def text_file_paths(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """The files `load_text_files` reads: each path, a folder meaning every `*.txt` under it (sorted).

    Raises `FileNotFoundError` (one line, naming the path) for a path that does not
    exist or a folder without a `*.txt` file.
    """
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.rglob("*.txt"))
            if not found:
                raise FileNotFoundError(f"{p}: no *.txt file in this folder")
            files += found
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or folder")
    if not files:
        raise FileNotFoundError("no text files given")
    return files


def load_text_files(paths: Iterable[str | os.PathLike]) -> list[Document]:
    """Plain-text files as documents (a folder means every `*.txt` in it, sorted; see `text_file_paths`)."""
    return [Document(str(f), f.read_text(encoding="utf-8", errors="replace")) for f in text_file_paths(paths)]


def corpus_fingerprint(documents: Sequence[Document]) -> str:
    h = hashlib.sha256()
    for d in documents:
        h.update(d.name.encode("utf-8") + b"\0" + d.text.encode("utf-8") + b"\0")
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(documents: Sequence[Document], vocab_size: int):
    """Train a byte-level BPE tokenizer; returns a `PreTrainedTokenizerFast`.

    Ids 0, 1, 2 are `<|pad|>`, `<|bos|>`, `<|eos|>`; the 256 byte symbols come
    next, so `vocab_size` must be at least 259 (259 is a pure byte-level model).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {len(alphabet) + len(SPECIAL_TOKENS)} for byte-level BPE")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator((d.text for d in documents), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def tokenizer_path(vocab_size: int = 4096, max_chars: int | None = None, cache: str | os.PathLike | None = None) -> Path:
    """Folder of the embedded tokenizer; trained and saved there the first time."""
    docs = corpus_split("train", max_chars)
    key = f"v{_TOKENIZER_FORMAT}-bpe{vocab_size}-{corpus_fingerprint(docs)}"
    folder = Path(cache or cache_dir()) / "tokenizers" / key
    if not (folder / "tokenizer.json").exists():
        tokenizer = train_tokenizer(docs, vocab_size)
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        tokenizer.save_pretrained(tmp)
        (tmp / "corpus.json").write_text(
            json.dumps({"documents": len(docs), "characters": sum(len(d.text) for d in docs)}), encoding="utf-8"
        )
        try:
            tmp.rename(folder)  # atomic: a concurrent process either wins or finds the folder complete
        except OSError:
            if not (folder / "tokenizer.json").exists():
                raise
    return folder


def load_tokenizer(vocab_size: int = 4096, max_chars: int | None = None, cache: str | os.PathLike | None = None):
    """The embedded-corpus tokenizer (trained on the train split, or its `max_chars` prefix)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path(vocab_size, max_chars, cache))


# ---------------------------------------------------------------------------------------------
# Token streams and packing


# Characters of text tokenized in one call, at most (give or take one short document). A fast tokenizer
# holds about 200 bytes per character while it runs (offsets, alignments, Python ints), so its memory grows
# with the text of one call, not with the document (benchmarks/RESULTS.md, "One long document").
PIECE_CHARS = 1 << 16
# A document longer than that is cut into pieces of PIECE_CHARS / 8 characters, tokenized 8 to a call: a fast
# tokenizer encodes a batch's texts in parallel, and one text alone on one core.
LONG_DOCUMENT_PIECES = 8


def text_pieces(text: str | Iterable[str], max_chars: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in consecutive pieces of at most `max_chars` characters (their concatenation is `text`).

    `text` is one string, or one document given as consecutive parts (a very
    long document decoded a part at a time, so that it is never one string):
    the pieces are the same either way.

    Each cut is made just before a space that follows a character other than
    whitespace, the last such space in the piece. A tokenizer that
    pre-tokenizes with a regex in which a space can only begin a match (GPT-2's,
    Llama 3's and Qwen's byte-level BPE, the embedded tokenizer) never merges
    across that point, so the pieces' tokens, concatenated, are exactly the
    whole text's (`cuts_are_exact` checks a tokenizer for it). A piece that
    holds no such space (text without spaces: a long word, CJK, base64) is cut
    at `max_chars` characters; there the tokens may differ from the whole
    text's, though they still encode the same text.
    """
    pending, start = "", 0  # the text not yet cut holds pending[start:]
    for part in (text,) if isinstance(text, str) else text:
        pending, start = pending[start:] + part, 0  # a single string is not copied
        while len(pending) - start > max_chars:
            end = start + max_chars
            cut = pending.rfind(" ", start + 1, end + 1)
            while cut != -1 and pending[cut - 1].isspace():  # the first space of a run, where a match may begin
                cut = pending.rfind(" ", start + 1, cut)
            cut = end if cut == -1 else cut
            yield pending[start:cut]
            start = cut
    yield pending[start:]


# Texts whose cuts before a space (`text_pieces`) cover letters, digits, punctuation, runs of spaces and
# tabs, newlines and non-ASCII text.
_CUT_PROBES = ("The quick brown fox, jumping 12345 times: x = f(y) + 3.0;",
               "def f(a,  b):\n    return a\t+ b  # 'sum' of them",
               "Ünïcode café naïve — “quoted” text 日本語 ok")


def cuts_are_exact(tokenizer) -> bool:
    """Whether `tokenizer`'s tokens of the probe texts cut by `text_pieces`' rule (before a space that follows
    a character other than whitespace) are exactly those of the whole texts. False for a tokenizer that adds
    something at the start of each call (Llama 2's SentencePiece prepends "▁") or merges across spaces."""
    for text in _CUT_PROBES:
        whole = tokenizer(text, add_special_tokens=False)["input_ids"]
        for cut in (i for i in range(1, len(text)) if text[i] == " " and not text[i - 1].isspace()):
            parts = tokenizer([text[:cut], text[cut:]], add_special_tokens=False)["input_ids"]
            if parts[0] + parts[1] != whole:
                return False
    return True


# End-of-text tokens by the names tokenizers give them (GPT-2, SmolLM and Qwen; Llama 3; Llama 2 and Mistral; Gemma).
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def document_tokens(tokenizer) -> tuple[int | None, int | None]:
    """(the token each packed row starts with, the token after each document): the tokenizer's BOS and EOS,
    unless they are chat markers.

    An Instruct tokenizer's BOS and EOS are often its chat template's turn markers (SmolLM2-Instruct's
    `<|im_start|>` and `<|im_end|>`). Plain text joined by them would read as chat turns; the model saw
    its end-of-text token between documents in pretraining. So a BOS or EOS that the chat template
    writes is replaced by the tokenizer's end-of-text token (the first of `END_OF_TEXT` it knows and the
    template does not write); where it has none, it stays. A row starts with the EOS where there is no BOS.
    """
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else ""
    vocab = tokenizer.get_vocab() if template else {}
    end = next((vocab[name] for name in END_OF_TEXT if name in vocab and name not in template), None)

    def plain(token_id: int | None) -> int | None:
        if token_id is None or end is None or tokenizer.convert_ids_to_tokens(token_id) not in template:
            return token_id
        return end

    bos, eos = plain(tokenizer.bos_token_id), plain(tokenizer.eos_token_id)
    return (bos if bos is not None else eos), eos


def encode_documents(tokenizer, texts: Iterable[str | Iterable[str]],
                     max_chars: int = PIECE_CHARS) -> Iterator[np.ndarray]:
    """The token ids of `texts`, every document followed by EOS, as consecutive int32 arrays.

    A document is a string, or consecutive parts of one (see `text_pieces`). A
    document of up to `max_chars` characters is one piece; a longer one is cut
    into `text_pieces` of `max_chars / LONG_DOCUMENT_PIECES` characters at most.
    Consecutive pieces are tokenized together, one batched call per `max_chars`
    characters at most. So memory holds the tokens of `max_chars` characters at
    a time, whatever a document's length. An empty document is its EOS alone.
    """
    eos = document_tokens(tokenizer)[1]
    batch, ends, size = [], [], 0  # pieces, whether each ends its document, their characters

    def encode() -> np.ndarray:
        ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
        return np.concatenate([np.asarray(x + [eos] if end else x, dtype=np.int32) for x, end in zip(ids, ends)])

    for text in texts:
        whole = isinstance(text, str) and len(text) <= max_chars
        pieces = text_pieces(text, max_chars if whole else max(1, max_chars // LONG_DOCUMENT_PIECES))
        piece = next(pieces)  # there is always one, if only ""
        for following in itertools.chain(pieces, [None]):
            if batch and size + len(piece) > max_chars:
                yield encode()
                batch, ends, size = [], [], 0
            batch.append(piece)
            ends.append(following is None)
            size += len(piece)
            piece = following
    if batch:
        yield encode()


def token_stream(tokenizer, documents: Sequence[Document]) -> np.ndarray:
    """All documents' token ids, each followed by EOS, as one int32 array (see `encode_documents`)."""
    pieces = list(encode_documents(tokenizer, (d.text for d in documents)))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def spread_rows(rows: torch.Tensor, n: int) -> torch.Tensor:
    """`n` rows evenly spaced over `rows` `[N, T]` (all of them when N <= n): evaluation rows taken from the
    start of a packed stream would cover its first documents only (32 rows of 256 tokens, 5 of 15 topics)."""
    if len(rows) <= n:
        return rows
    return rows[np.linspace(0, len(rows) - 1, n).round().astype(np.int64)]


def pack(stream: np.ndarray, seq_len: int, bos_id: int, max_rows: int | None = None) -> torch.Tensor:
    """Cut `stream` into rows `[N, seq_len]`, each `bos_id` followed by `seq_len - 1` stream tokens.

    The tail that does not fill a row is dropped.
    """
    if seq_len < 2:
        raise ValueError("seq_len must be at least 2 (BOS plus one token)")
    body = seq_len - 1
    n = len(stream) // body
    if max_rows is not None:
        n = min(n, max_rows)
    rows = torch.from_numpy(np.asarray(stream[: n * body], dtype=np.int64)).view(n, body)  # [N, T-1]
    bos = torch.full((n, 1), bos_id, dtype=torch.int64)
    return torch.cat([bos, rows], dim=1)  # [N, T]


def corpus_tokens(tokenizer, split: str, max_chars: int | None = None, corpus: str = "embedded") -> np.ndarray:
    """The token stream of a corpus split (`documents`); cached beside the tokenizer if it is the embedded one.

    (Only a folder written by `tokenizer_path`, marked by its `corpus.json`, gets
    the cache; a model's own folder is never written to.) The cache file is
    named by the split's `corpus_fingerprint`; a JSON file beside it records
    documents, characters and tokens.
    """
    docs = documents(corpus, split, max_chars)
    folder = Path(tokenizer.name_or_path) if tokenizer.name_or_path else None
    if folder is None or not (folder / "corpus.json").exists():
        return token_stream(tokenizer, docs)
    fingerprint = corpus_fingerprint(docs)
    path = folder / f"tokens-{split}-{fingerprint}.npy"
    if path.exists():
        return np.load(path)
    stream = token_stream(tokenizer, docs)
    tmp = path.with_name(path.stem + f".tmp{os.getpid()}.npy")
    np.save(tmp, stream)
    os.replace(tmp, path)
    info = {"corpus": corpus, "split": split, "fingerprint": fingerprint, "documents": len(docs),
            "characters": sum(len(d.text) for d in docs), "tokens": int(len(stream))}
    if corpus == "packages":
        info.update(package_corpus_manifest())
    path.with_suffix(".json").write_text(json.dumps(info, indent=1), encoding="utf-8")
    return stream


# ---------------------------------------------------------------------------------------------
# What the examples call


def tokenizer_for(model_name_or_path: str, vocab_size: int | None = None, **kwargs):
    """The model's own tokenizer when it has one, else the embedded-corpus tokenizer.

    `vocab_size` (the model's) must then be large enough for the embedded
    tokenizer, which is trained with that many tokens; kwargs go to `AutoTokenizer`.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_name_or_path, **kwargs)
    except (OSError, ValueError, TypeError):
        if vocab_size is None:
            raise
        warnings.warn(
            f"{model_name_or_path} has no tokenizer: using the embedded-corpus tokenizer with {vocab_size} tokens "
            "(right for models trained on the embedded corpus, meaningless for others)",
            stacklevel=2,
        )
        return load_tokenizer(vocab_size)


def packed_rows(
    tokenizer,
    seq_len: int,
    *,
    text_files: Sequence[str] | None = None,
    split: str = "train",
    max_chars: int | None = None,
    max_rows: int | None = None,
) -> torch.Tensor:
    """Packed rows `[N, seq_len]` from text files, or from the embedded corpus's `split`.

    Each row starts with the tokenizer's BOS token (EOS when it has none, as
    some tokenizers do; its end-of-text token where those are chat markers: `document_tokens`).
    """
    if text_files:
        stream = token_stream(tokenizer, load_text_files(text_files))
    else:
        stream = corpus_tokens(tokenizer, split, max_chars)
    bos = document_tokens(tokenizer)[0]
    if bos is None:
        raise ValueError("the tokenizer has neither a BOS nor an EOS token to start each packed sequence with")
    return pack(stream, seq_len, bos, max_rows=max_rows)
