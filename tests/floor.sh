#!/usr/bin/env bash
# The oldest transformers the package declares (pyproject.toml, gated_attention/compat.py), tested:
# the tests that touch every model family, generate, the caches (SinkCache too), remote code, conversion,
# checkpoint loading (the loading info hub/loading.py reads), analysis, tensor parallelism, the paper's own layouts and quantization,
# on transformers==5.17.0 in a throwaway venv (tests/with_transformers.sh).
# Usage: bash tests/floor.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash tests/with_transformers.sh "transformers==5.17.0" "$@" \
    tests/test_compat.py tests/test_dense.py tests/test_moe.py tests/test_hybrid.py tests/test_families.py tests/test_sink_cache.py \
    tests/test_convert.py tests/test_convert_export.py tests/test_convert_rope.py tests/test_convert_errors.py tests/test_convert_source_config.py tests/test_convert_memory.py tests/test_declared.py \
    tests/test_analysis_capture.py tests/test_analyze_architectures.py tests/test_serving.py tests/test_tensor_parallel.py tests/test_readme_code.py \
    tests/test_loading.py tests/test_hub_push.py tests/test_paper_layouts.py tests/test_quantization.py tests/test_trained_model.py::test_the_gguf_file_converts_exactly_and_the_card_names_it
