#!/usr/bin/env bash
# The newest transformers the package's pins admit (pyproject.toml), tested with the whole suite,
# in a throwaway venv (tests/with_transformers.sh): run it when a release comes out, before users
# meet it. A failure here means the release needs a change in gated_attention/compat.py (or the
# one place its kind of difference lives) before the pin may admit it.
# Usage: bash tests/newest.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
# The installed package's metadata is pyproject.toml's, as pip read it (`pip install -e .` refreshes it).
pin="$(python -c 'import importlib.metadata as m; print(next(r for r in m.requires("gated-attention") if r.startswith("transformers")))')"
exec bash tests/with_transformers.sh "$pin" "$@"
