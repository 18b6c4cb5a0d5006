#!/usr/bin/env bash
# The oldest transformers the package declares (pyproject.toml, gated_attention/compat.py), tested.
#
# A throwaway venv on top of the current environment (--system-site-packages: torch,
# fla, accelerate, peft and the editable package are shared) gets transformers==5.17.0
# and the huggingface_hub 1.x it needs, then runs the tests that touch every model
# family, generate, the cache, remote code and conversion. Usage: bash tests/floor.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)/floor"
trap 'rm -rf "$(dirname "$venv")"' EXIT
python -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "transformers==5.17.0"
"$venv/bin/python" -c 'import transformers as t; assert t.__version__ == "5.17.0", t.__version__; print("floor: transformers", t.__version__)'
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" \
    tests/test_compat.py tests/test_dense.py tests/test_moe.py tests/test_hybrid.py tests/test_families.py \
    tests/test_convert.py tests/test_convert_export.py tests/test_convert_rope.py tests/test_convert_errors.py tests/test_convert_source_config.py \
    tests/test_analysis_capture.py tests/test_serving.py
