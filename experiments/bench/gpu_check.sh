#!/usr/bin/env bash
# Every GPU check in one prepared run (an H100/H200; about 9 minutes: run it with timeout_s 600):
#   1. experiments/bench/kernels.py: decode attention per page format, Llama-3-8B and SmolLM2
#      shapes at batch 64 x 32k, with a sweep of launch configs, beside jax's own GPU paged
#      attention (bf16 pages); with BEFORE=DIR, bf16 and the packed formats again with
#      DIR/kernels_pallas (an earlier kernel, e.g. `git show` of an older commit) in the same
#      run: an A/B on the same device;
#   2. the kernel tests compiled on the GPU (KVJAX_PALLAS_COMPILED=1, tests/kernel_mode.py),
#      tests/test_paged_attention.py first;
#   3. experiments/bench/gpu_model_check.py: whole-model impl="pallas" beside impl="xla".
# Each step has its own time limit, so one that fails or hangs does not lose the others.
# Learned on an H200 (docs/DECISIONS.md "GPU checks run as one prepared script"): the Mosaic
# kernel's packed cases fail and hang compiled (they do not lower yet), so they are deselected;
# the model step compiles 2 impls x 3 methods, so it runs --layers 4 within its limit.
# Writes env.txt, bench_llama3-8b.json, bench_smollm2.json, bench_before.json, bench.log,
# tests.log, model_check.json and model.log under $OUT (default experiments/out/gpu): 8 files,
# as many as a device call brings back. The JSON rows carry device, driver, jax version and
# command; `python experiments/bench/gpu_report.py FILES` turns them into BENCHMARKS' tables.
#
#   OUT=/tmp/gpu bash experiments/bench/gpu_check.sh
#   BEFORE=experiments/out/before OUT=/tmp/gpu bash experiments/bench/gpu_check.sh   # with A/B
#   BENCH_S=150 TESTS_S=150 MODEL_S=110 bash experiments/bench/gpu_check.sh   # step limits (s)
set -u
OUT=${OUT:-experiments/out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVJAX_NO_DOWNLOAD=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
ROOT=$PWD
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
SCRATCH=$(mktemp -d)

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.txt"

echo "== 1. kernel benchmark"
bench() {  # name, shape, time limit, extra args
  local name=$1 shape=$2 limit=$3; shift 3
  timeout "$limit" $PY experiments/bench/kernels.py --shapes "$shape" --batches 64 \
    --contexts 32768 --budget-s 600 --out "$SCRATCH/$name" "$@" >>"$OUT/bench.log" 2>&1
  echo "bench $name exit $?"
  cp "$SCRATCH/$name.json" "$OUT/" 2>/dev/null
}
bench bench_llama3-8b llama3-8b "${BENCH_S:-150}" --formats bf16 fp8 int8 int4 kivi4 kivi2 \
  --launch 0 4x1 8x2 4x2
bench bench_smollm2 smollm2 "${BENCH_SMALL_S:-55}" --formats bf16 fp8 int8 int4 kivi4 --launch 0 4x2 4x1
if [ -n "${BEFORE:-}" ]; then  # the earlier kernel on the same device, same pages
  PYTHONPATH="$ROOT/$BEFORE:$PYTHONPATH" $PY -c "import kernels_pallas as k; print('before:', k.__file__)" >>"$OUT/bench.log" 2>&1
  PYTHONPATH="$ROOT/$BEFORE:$PYTHONPATH" bench bench_before llama3-8b "${BEFORE_S:-60}" \
    --formats bf16 int8 int4 kivi4
fi
grep -E "^\| (llama|smollm)" "$OUT/bench.log" | cut -c1-120

echo "== 2. kernel tests, compiled"
KVJAX_PALLAS_COMPILED=1 timeout "${TESTS_S:-150}" $PY -m pytest -q -n 8 -p no:cacheprovider \
  -o addopts="" -rfE --timeout 120 tests/test_paged_attention.py tests/test_gpu_kernel.py \
  tests/test_kernel_attention.py tests/test_mgpu_kernel.py \
  --deselect "tests/test_mgpu_kernel.py::test_matches_reference[int4-tokens-g32]" \
  --deselect "tests/test_mgpu_kernel.py::test_matches_reference[int4-tokens-sym-g64]" \
  >"$OUT/tests.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -20

echo "== 3. whole model"
timeout "${MODEL_S:-110}" $PY experiments/bench/gpu_model_check.py --layers "${LAYERS:-4}" \
  --out "$OUT/model_check.json" >"$OUT/model.log" 2>&1
echo "model exit $?"; grep -E "^\{" "$OUT/model.log" | cut -c1-300
