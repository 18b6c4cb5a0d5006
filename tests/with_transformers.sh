#!/usr/bin/env bash
# Run tests on another transformers release than the one installed, in a throwaway venv.
#
# Usage: bash tests/with_transformers.sh REQUIREMENT [pytest args]
#        bash tests/with_transformers.sh REQUIREMENT --python SCRIPT [args]   (runs SCRIPT instead of pytest)
#   REQUIREMENT: what pip installs, e.g. "transformers==5.17.0" (tests/floor.sh) or
#   "transformers>=5.17,<6" with --upgrade semantics (tests/newest.sh takes the newest the pins admit),
#   or "transformers==4.51.3", the release the paper's own code runs on (tests/paper_reference.py).
#
# The venv sits on top of the current environment (tests/overlay_venv.sh): torch, fla, accelerate,
# peft and the editable package are shared, only transformers (and the huggingface_hub it needs) is its own.
# With KEEP_VENV=DIR the venv is built in DIR and kept (reused when it has the release already).
set -euo pipefail
cd "$(dirname "$0")/.."
requirement="$1"; shift
if [[ -n "${KEEP_VENV:-}" ]]; then
    venv="$KEEP_VENV"
else
    venv="$(mktemp -d)/transformers"
    trap 'rm -rf "$(dirname "$venv")"' EXIT
fi
bash tests/overlay_venv.sh "$venv"
"$venv/bin/python" -c 'import torch, accelerate, peft' || { echo "$0: the current environment's packages are not visible in the scratch venv" >&2; exit 1; }
# --upgrade: a range takes its newest release here even though the shared environment already satisfies it.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade "$requirement"
"$venv/bin/python" - "$requirement" <<'PY'
import sys
import transformers
from packaging.requirements import Requirement

requirement = Requirement(sys.argv[1])
assert requirement.specifier.contains(transformers.__version__), (sys.argv[1], transformers.__version__)
print(f"{requirement.name} {transformers.__version__} ({sys.argv[1]}) from {transformers.__file__}")
PY
if [[ "${1:-}" == "--python" ]]; then
    shift
    exec "$venv/bin/python" "$@"
fi
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
