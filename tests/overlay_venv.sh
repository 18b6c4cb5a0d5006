#!/usr/bin/env bash
# Make a venv at DIR (kept if it exists) that sees the current environment's packages after its own.
#
# Usage: bash tests/overlay_venv.sh DIR
#
# "The current environment" is the one `python` runs in, a venv or not. A .pth file in DIR's
# site-packages adds the current environment's site-packages folders (with `site.addsitedir`, so their
# own .pth files, e.g. an editable install's, work too) after DIR's own: torch and the rest are shared,
# not fetched again, and what pip installs in DIR shadows them without touching them (pip does not
# uninstall outside its own environment). `--system-site-packages` would share the *base*
# interpreter's packages instead: from inside a venv, those lack torch.
# Used by tests/with_transformers.sh (another transformers) and .ci/run (the package installed by CI).
set -euo pipefail
venv="$1"
[[ -x "$venv/bin/python" ]] || python -m venv "$venv"
site_packages="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
python - "$site_packages/zz_current_environment.pth" <<'PY'
import os, site, sys
folders = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
with open(sys.argv[1], "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in folders if os.path.isdir(d)) + "\n")
PY
"$venv/bin/python" -c 'import torch' || { echo "$0: the current environment's packages are not visible in $venv" >&2; exit 1; }
