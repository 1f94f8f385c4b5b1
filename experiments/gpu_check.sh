#!/usr/bin/env bash
# Every GPU check in one prepared run (an H100/H200; under 10 minutes: run it with timeout_s 600):
#   1. the kernel tests compiled on the GPU (KVJAX_PALLAS_COMPILED=1, tests/kernel_mode.py);
#   2. experiments/bench_kernels.py: decode attention per page format, beside jax's own kernel;
#   3. experiments/gpu_model_check.py: whole-model impl="pallas" beside impl="xla".
# Each step has its own time limit, so one that fails or hangs does not lose the others.
# Learned on an H200 (docs/DECISIONS.md "GPU checks run as one prepared script"): the Mosaic
# kernel's packed cases fail and hang compiled (they do not lower yet), so they are deselected;
# the model step compiles 30 layers x 2 impls x 3 methods and needed more than 130 s.
# Writes env.txt, tests.log, bench_kernels.{json,csv,png}, bench.log, model_check.json and
# model.log under $OUT (default experiments/out/gpu).
#
#   OUT=/tmp/gpu bash experiments/gpu_check.sh
#   TESTS_S=150 BENCH_BUDGET_S=130 bash experiments/gpu_check.sh   # the step limits (seconds)
set -u
OUT=${OUT:-experiments/out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVJAX_NO_DOWNLOAD=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.txt"

echo "== 1. kernel tests, compiled"
KVJAX_PALLAS_COMPILED=1 timeout "${TESTS_S:-150}" $PY -m pytest -q -p no:cacheprovider \
  -o addopts="" -rfE --timeout 90 tests/test_gpu_kernel.py tests/test_mgpu_kernel.py \
  tests/test_paged_attention.py tests/test_kernel_attention.py \
  --deselect "tests/test_mgpu_kernel.py::test_matches_reference[int4-tokens-g32]" \
  --deselect "tests/test_mgpu_kernel.py::test_matches_reference[int4-tokens-sym-g64]" \
  >"$OUT/tests.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -25

echo "== 2. kernel benchmark"
timeout "$(( ${BENCH_BUDGET_S:-130} + 60 ))" $PY experiments/bench_kernels.py \
  --out "$OUT/bench_kernels" --budget-s "${BENCH_BUDGET_S:-130}" \
  --batches ${BATCHES:-64 8} --contexts ${CONTEXTS:-32768 8192} >"$OUT/bench.log" 2>&1
echo "bench exit $?"; grep -E "^\|" "$OUT/bench.log" | cut -c1-150

echo "== 3. whole model"
timeout "${MODEL_S:-240}" $PY experiments/gpu_model_check.py --out "$OUT/model_check.json" \
  >"$OUT/model.log" 2>&1
echo "model exit $?"; grep -E "^\{" "$OUT/model.log" | cut -c1-400
