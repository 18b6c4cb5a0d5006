#!/usr/bin/env bash
# The oldest transformers the package declares (pyproject.toml, gated_attention/compat.py), tested.
#
# A throwaway venv on top of the current environment (torch, fla, accelerate, peft and
# the editable package are shared) gets transformers==5.17.0 and the huggingface_hub 1.x
# it needs, then runs the tests that touch every model family, generate, the cache,
# remote code, conversion and checkpoint loading (the loading info hub/loading.py reads).
# Usage: bash tests/floor.sh [pytest args]
#
# "The current environment" is the one `python` runs in, a venv or not. A .pth file
# in the floor venv adds its site-packages folders (with `site.addsitedir`, so their
# own .pth files, e.g. the editable install's, work too) after the floor venv's own.
# (`--system-site-packages` would share the *base* interpreter's packages instead:
# from inside a venv, those lack torch.)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)/floor"
trap 'rm -rf "$(dirname "$venv")"' EXIT
python -m venv "$venv"
floor_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
python - "$floor_site/zz_current_environment.pth" <<'PY'
import os, site, sys
folders = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
with open(sys.argv[1], "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in folders if os.path.isdir(d)) + "\n")
PY
"$venv/bin/python" -c 'import torch, accelerate, peft' || { echo "floor: the current environment's packages are not visible in the floor venv" >&2; exit 1; }
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "transformers==5.17.0"
"$venv/bin/python" -c 'import transformers as t; assert t.__version__ == "5.17.0", t.__version__; print("floor: transformers", t.__version__)'
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" \
    tests/test_compat.py tests/test_dense.py tests/test_moe.py tests/test_hybrid.py tests/test_families.py \
    tests/test_convert.py tests/test_convert_export.py tests/test_convert_rope.py tests/test_convert_errors.py tests/test_convert_source_config.py tests/test_convert_memory.py \
    tests/test_analysis_capture.py tests/test_analyze_architectures.py tests/test_serving.py tests/test_tensor_parallel.py tests/test_readme_code.py \
    tests/test_loading.py tests/test_trained_model.py::test_the_gguf_file_converts_exactly_and_the_card_names_it
