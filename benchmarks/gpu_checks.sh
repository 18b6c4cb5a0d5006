#!/usr/bin/env bash
# Everything in this project that needs a CUDA GPU, in one run of about 9 minutes at most, printing every figure:
#   1. kernels  the Triton gated-SDPA tests on CUDA (one launch config each, as tests/conftest.py pins it),
#               the model-level "gated_triton" tests and the default-implementation tests
#   2. fla      fla's CUDA kernels against our torch gated delta rule, forward and every gradient at head sizes
#               64 and 128 (tests/test_gated_delta_rule.py -k cuda): fla #640 gave wrong dg/dbeta on Hopper with
#               Triton 3.4 up to 3.7.1 without a word; fla >= 0.5.2 refuses that range, which the test accepts there only
#   2b. fla-paths  fla's CUDA kernels of every linear-attention family against the torch paths that
#               fla_torch_paths() runs on CPUs, op by op, and each fla model family as a hybrid on the GPU
#               against the same model on the CPU, with the torch attention's weights read on the GPU
#               (tests/test_fla_ops.py, tests/test_fla_torch_paths.py -k cuda; fla's kernels autotune, so -v
#               shows how far a run got if the time limit stops it)
#   3. sdpa     benchmarks/gated_sdpa.py: fused against the default SDPA dispatch, each SDPA backend and
#               flash-attn (where installed), forward, forward+backward and decode (this part autotunes)
#   4. models   benchmarks/gpu_models.py: training step, agreement, generate and MoE (4a); the hybrid against
#               transformers' Qwen3.5 and torch.compile(fullgraph=True) (4b)
# Each part runs under its own `timeout` (seconds below; 540 in all), so a hang costs one part, not the run.
#
# Run from the repository root: bash benchmarks/gpu_checks.sh
# No install is needed: the repository goes on PYTHONPATH. Wheels found in $GPU_WHEELS (default .whl/) are
# installed first into /tmp/site, which goes first on PYTHONPATH: the H200 image this was first run on had
# transformers 5.17 (supported: it is the declared floor) and no fla. Fetch fla on a machine with network
# access, from the repository root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     flash-linear-attention==0.6.0 fla-core==0.6.0
# and carry .whl along.
# With $OUT set, the whole log goes to $OUT/gpu_checks.log and the kernel benchmark's rows to
# $OUT/gated_sdpa.csv. Exits 0 with a message where there is no GPU; else 1 if any part failed.
set -u
cd "$(dirname "$0")/.."

TIMEOUT_KERNELS=60 TIMEOUT_FLA=110 TIMEOUT_FLA_PATHS=180 TIMEOUT_SDPA=80 TIMEOUT_MODELS=60 TIMEOUT_MODELS_B=50
OUT_DIR="${OUT:-}"
export PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"

status=0
failed=""

part() {  # part NAME SECONDS COMMAND...: run one part under its own time limit
    local name=$1 seconds=$2
    shift 2
    echo
    echo "=== $name (time limit ${seconds} s): $*"
    local start=$SECONDS
    timeout -k 5 "$seconds" "$@"
    local rc=$?
    if [ $rc = 124 ] || [ $rc = 137 ]; then
        echo "=== $name: STOPPED at its ${seconds} s limit"
    fi
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    if [ $rc != 0 ]; then status=1; failed="$failed $name"; fi
}


main() {  # everything after the variables above, so that its output can go through one tee
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        echo "gpu_checks: no GPU on this machine: nothing to check (exit 0)"
        return 0
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

    WHEELS="${GPU_WHEELS:-.whl}"
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "gpu_checks: installing carried wheels: $(cd "$WHEELS" && ls *.whl | tr '\n' ' ')"
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WHEELS"/*.whl || { echo "gpu_checks: installing the wheels FAILED"; return 1; }
        export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    else
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PYTHON" - <<'EOF' || { echo "gpu_checks: torch sees no CUDA device: nothing to check (exit 0)"; return 0; }
import importlib.util, torch, triton, transformers
if not torch.cuda.is_available(): raise SystemExit("torch.cuda.is_available() is False")
fla = importlib.util.find_spec("fla")
print(f"torch {torch.__version__} (cuda {torch.version.cuda}) | triton {triton.__version__} | "
      f"transformers {transformers.__version__} | fla {'present' if fla else 'MISSING: the fla part will skip'}")
EOF

    part kernels "$TIMEOUT_KERNELS" "$PYTHON" -m pytest -q -rA -p no:cacheprovider \
        tests/test_gated_sdpa_triton.py tests/test_gated_sdpa.py
    part fla "$TIMEOUT_FLA" "$PYTHON" -m pytest -q -rA -p no:cacheprovider tests/test_gated_delta_rule.py -k cuda
    part fla-paths "$TIMEOUT_FLA_PATHS" "$PYTHON" -m pytest -v -rA -p no:cacheprovider \
        tests/test_fla_ops.py tests/test_fla_torch_paths.py -k cuda
    part sdpa "$TIMEOUT_SDPA" "$PYTHON" benchmarks/gated_sdpa.py --seqlens 1024 4096 8192 16384 \
        --decode-cache 4096 65536 ${OUT_DIR:+--csv "$OUT_DIR/gated_sdpa.csv"}
    part models "$TIMEOUT_MODELS" "$PYTHON" benchmarks/gpu_models.py --parts train agree generate moe
    part models-b "$TIMEOUT_MODELS_B" "$PYTHON" benchmarks/gpu_models.py --parts hybrid compile

    echo
    echo "gpu_checks: $([ $status = 0 ] && echo 'all parts passed' || echo "FAILED:$failed") in $SECONDS s"
    return $status
}

if [ -n "$OUT_DIR" ]; then
    main 2>&1 | tee "$OUT_DIR/gpu_checks.log"
    exit "${PIPESTATUS[0]}"
fi
main
