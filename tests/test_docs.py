"""The docs that live in the repository: the licence, the architecture page, the folder maps, the README.

Nothing here runs a model. The checks read files, plus the command-line parser
(argparse only), so the whole module takes about as long as importing the package.
"""

from __future__ import annotations

import ast
import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gated_attention"
README = (ROOT / "README.md").read_text(encoding="utf-8")
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MISSING_DOC = "DESIGN" + ".md"  # split, so that this file does not name it itself
# Top-level folders whose paths the docs cite; a cited path under one of them must exist.
REPO_FOLDERS = ("gated_attention", "examples", "benchmarks", "tests", "docs", "model_cards", ".ci")
PACKAGES = sorted(p.parent for p in PACKAGE.rglob("__init__.py"))


def _text_files():
    for pattern in ("*.py", "*.md", "*.sh", "*.toml", "*.yaml", "*.yml"):
        yield from (p for p in ROOT.rglob(pattern) if ".git" not in p.parts and p != Path(__file__).resolve())
    yield ROOT / ".ci" / "run"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not `-` or `_`), spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _code_blocks(markdown: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", markdown, flags=re.M | re.S)


def test_licence_is_the_apache_2_text_pyproject_declares():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["license"]
    assert declared == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"], text[:200]
    for clause in ("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION", "9. Accepting Warranty or Additional Liability",
                   "END OF TERMS AND CONDITIONS"):
        assert clause in text, f"LICENSE lacks {clause!r}: not the full Apache 2.0 text"


def test_no_file_cites_a_design_doc_the_repository_lacks():
    assert ARCHITECTURE.exists()
    citing = [str(p.relative_to(ROOT)) for p in _text_files() if MISSING_DOC in p.read_text(encoding="utf-8")]
    if not (ROOT / MISSING_DOC).exists():
        assert not citing, f"{MISSING_DOC} is not in the repository, but these files cite it: {citing}"


def test_citations_of_the_architecture_doc_name_its_headings():
    """`docs/architecture.md, "Heading"` in a comment or docstring names a heading the page has."""
    headings = set(re.findall(r"^#+ (.*)$", ARCHITECTURE.read_text(encoding="utf-8"), flags=re.M))
    cited = {(str(p.relative_to(ROOT)), h) for p in _text_files()
             for h in re.findall(r'docs/architecture\.md,?\s*\(?"([^"\n]+)"', p.read_text(encoding="utf-8"))}
    assert cited, "no citations found: the pattern no longer matches how the code cites the page"
    unknown = sorted((path, h) for path, h in cited if h not in headings)
    assert not unknown, f"citations of headings docs/architecture.md does not have: {unknown}"


def test_architecture_doc_lists_the_layers_of_the_layout_test():
    """The layering lives in two places, the page people read and the test that enforces it: they agree."""
    from test_layout import LAYERS

    documented: dict[int, set[str]] = {}
    for rank, part in re.findall(r"^\| (\d+) \| `(\w+)` \|", ARCHITECTURE.read_text(encoding="utf-8"), flags=re.M):
        documented.setdefault(int(rank), set()).add(part)
    assert documented == dict(enumerate(LAYERS))


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_package_init_maps_its_files(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    unnamed = [f.name for f in sorted(package.glob("*.py"))
               if f.name != "__init__.py" and f"`{f.stem}`" not in doc and f.name not in doc]
    assert not unnamed, f"{package.relative_to(ROOT)}/__init__.py's docstring does not map {unnamed}"


DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
        "benchmarks/RESULTS.md", "benchmarks/sink_search.md", "benchmarks/stability_search.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_links_point_at_files_and_headings_that_exist(doc):
    path = ROOT / doc
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not ours to check offline
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file) if file else path
        if not linked.exists():
            broken.append(target)
        elif anchor and anchor not in {_slug(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(encoding="utf-8"), flags=re.M)}:
            broken.append(target)
    assert not broken, f"{doc} links to missing files or headings: {broken}"


@pytest.mark.parametrize("doc", DOCS)
def test_paths_the_docs_name_exist(doc):
    """A path such as `gated_attention/compat.py` in a page, read from the repository's root, is there."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    cited = re.findall(rf"(?<![\w./~-])((?:{'|'.join(map(re.escape, REPO_FOLDERS))})/[\w./-]*)", text)
    missing = sorted({c.rstrip(".,") for c in cited if "*" not in c and not (ROOT / c.rstrip(".,")).exists()})
    assert not missing, f"{doc} names paths that are not in the repository: {missing}"


def _readme_commands(program: str) -> list[list[str]]:
    """Every `program ...` command line in the README's bash blocks (continuations joined, comments dropped)."""
    commands = []
    for block in _code_blocks(README, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == [program]:
                commands.append(words[1:])
    return commands


def test_readme_gated_attention_commands_parse(tmp_path, monkeypatch):
    """Each `gated-attention ...` line in the README is accepted by the parser as written (nothing runs).

    The parser checks that input files exist, so the one the README names is made, empty, in a scratch folder."""
    from gated_attention.cli import build_parser

    monkeypatch.chdir(tmp_path)
    (tmp_path / "inputs.txt").write_text("")
    commands = _readme_commands("gated-attention")
    assert {c[0] for c in commands} >= {"quickstart", "convert", "extend", "export", "analyze"}
    for argv in commands:
        args = build_parser().parse_args(argv)
        assert callable(args.func), argv


def test_readme_keeps_the_install_and_ci_test_commands():
    """CI runs what the README tells users to run: the same install and the same two test commands, in a venv of
    its own (an install into the machine's python would point its editable install at CI's throwaway clone)."""
    blocks = "\n".join(_code_blocks(README, "bash"))
    assert 'python -m pip install -e ".[dev]"' in blocks
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    own = ci.index('source "$venv/bin/activate"')
    assert ci[own - 1] == 'bash tests/overlay_venv.sh "$venv"'
    tests = [line for line in ci[own:] if line.startswith(("python -m pytest", "bash tests/"))]
    assert tests == ["python -m pytest -q", "bash tests/floor.sh"]
    assert all(t in blocks for t in tests), tests
    assert 'python -m pip install --quiet -e ".[dev]"' in ci[own:]
