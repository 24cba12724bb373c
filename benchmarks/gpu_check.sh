#!/usr/bin/env bash
# The runtime's GPU check, prepared for the first machine with a GPU (one GPU, under 10 minutes):
#   1. the runtime tests with the models on the GPU (PDD_TEST_DEVICE=cuda): greedy output against
#      generate() on the CPU, extend against decode steps, KV round trips, the fused loop against
#      transformers' forward, CUDA-graph decode steps against eager ones (KV included);
#   2. the runtime figures (benchmarks/gpu_check.py): decode at batch 1, 8, 32 with and without
#      CUDA graphs, prefill tok/s, extend of 100 tokens, KV export/import GB/s, for SmolLM2 and a
#      random Llama-3-8B-shaped model.
# Output in OUT (default gpu_check_out/): tests.log, tests.xml, figures.log and gpu_check.json
# (figures + test counts). Exit status: 0 when the tests passed and the figures were written.
#
#   benchmarks/gpu_check.sh [OUT]
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_QUICK=1 GPU_CHECK_TESTS=tests/runtime/test_runtime_perf_pool.py \
#       benchmarks/gpu_check.sh OUT        # CPU smoke run (tests/runtime/test_gpu_check.py): format only
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-gpu_check_out}
PY=${PY:-.venv/bin/python}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
TESTS=${GPU_CHECK_TESTS:-tests/runtime}
MODELS=${GPU_CHECK_MODELS:-smollm2,llama3_8b_shape}
QUICK=()
[[ "${GPU_CHECK_QUICK:-0}" == "1" ]] && QUICK=(--quick)
mkdir -p "$OUT"

if [[ "$DEVICE" == cuda* ]]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "gpu_check: CUDA is not available to $PY" >&2; exit 2; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/nvidia-smi.csv" 2>&1 || true
fi

echo "[gpu_check] 1/2 runtime tests on $DEVICE: $TESTS" >&2
# deselected: a CLI smoke test that has nothing to do with the device
PDD_TEST_DEVICE=$DEVICE timeout 300 "$PY" -m pytest -q -p no:cacheprovider $TESTS \
    --deselect tests/runtime/test_models.py::test_model_dir_command_prints_a_loadable_folder \
    --junitxml "$OUT/tests.xml" >"$OUT/tests.log" 2>&1
tests_rc=$?
tail -n 3 "$OUT/tests.log" >&2

echo "[gpu_check] 2/2 runtime figures on $DEVICE" >&2
timeout 420 "$PY" benchmarks/gpu_check.py --device "$DEVICE" --models "$MODELS" "${QUICK[@]}" --out "$OUT/gpu_check.json" \
    --junit "$OUT/tests.xml" --tests-rc "$tests_rc" 2>"$OUT/figures.log"
figures_rc=$?
tail -n 3 "$OUT/figures.log" >&2

echo "[gpu_check] tests exit $tests_rc, figures exit $figures_rc; results in $OUT/gpu_check.json" >&2
[[ $tests_rc -eq 0 && $figures_rc -eq 0 ]]
