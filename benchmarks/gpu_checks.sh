#!/usr/bin/env bash
# Everything in this project that needs a CUDA GPU, in one run, printing every figure:
#   1. the Triton gated-SDPA kernel tests, in-process on CUDA (fp32, fp16 and bf16 against the torch reference,
#      the model-level "gated_triton" tests, packed sequences, decode);
#   2. fla's CUDA kernels against our torch gated delta rule;
#   3. benchmarks/gated_sdpa.py: fused kernel against SDPA (flash) + gate, forward, forward+backward, decode.
# Run from the repository root after `pip install -e ".[dev]"` on the GPU machine:  bash benchmarks/gpu_checks.sh
# Exits non-zero if a test or the benchmark failed; both always run.
set -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || { echo "no GPU: nothing to check"; exit 0; }
python -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda)"

status=0
python -m pytest -q -rA -p no:cacheprovider tests/test_gated_sdpa_triton.py tests/test_gated_delta_rule.py || status=1
python benchmarks/gated_sdpa.py "$@" || status=1
echo "gpu_checks: $([ $status = 0 ] && echo 'all passed' || echo 'FAILED')"
exit $status
