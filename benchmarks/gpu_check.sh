#!/usr/bin/env bash
# The CUDA path, proven on one GPU (issue 15). Run once on the target machine (one H200; Python 3.12,
# torch 2.11 with CUDA 13, Triton 3.6, transformers; no flash-attn):
#     bash benchmarks/gpu_check.sh          # PY=... to choose the interpreter, OUT=... for the results
# Parts, in order; each prints a table and one JSON line, and a failing part does not stop the next:
#   1. bench_attention.py: Triton (deterministic and atomic dq) vs torch's varlen_attn vs padded SDPA,
#      bf16, d = 64 and 128, 32/8 heads, causal, windows of 4,096 and 8,192; forward, preprocess, dk/dv
#      and dq times from the profiler. Estimate: ~2.5 min (Triton compiles ~30 configs, 2-4 s each,
#      and autotunes 4 keys; then 5 providers x 4 problems x ~25 timed calls, padded SDPA the slowest).
#   2. the CUDA tests with one fixed config per kernel (PACKKIT_TRITON_AUTOTUNE=0, so nothing is tuned),
#      the 65,536-segment static-shape batch included. Estimate: ~2 min (about 80 compiles: each
#      dtype / head dim / GQA group / causality the tests use is a kernel variant; then the tests).
#   3. bench_train_step.py: one training step of a ~150M-parameter Llama, packed (torch varlen_attn,
#      Triton, sdpa) vs padded sdpa on the same 64 examples. Estimate: ~1.5 min (4 providers x 8 steps,
#      the padded batch ~4x the real tokens; Triton compiles for d=64 and tunes 1 key).
#   4. kernel_resources.py --fixed: registers, spills and shared memory of the fixed configs as this
#      machine's Triton compiles them. Estimate: ~20 s.
# Total estimate: ~6.5 minutes of the 8 allowed. Each part has a hard timeout (170 + 170 + 100 + 30 s) so
# the script ends under 8 minutes whatever happens; the exit status lists the parts that failed (0 when none did).
# Results: $OUT/gpu_check.jsonl (every JSON line), $OUT/*.log (full output), $OUT/gpu_env.txt.
# The interpreter: $PY, else .venv/bin/python when its torch sees CUDA, else python3 (on the lent GPU
# machines the image's python3 holds a CUDA torch, Triton, pytest, hypothesis and transformers).
# packkit is installed into it from this tree (no dependencies, no index) when `packkit.kernels` cannot be
# imported (an interpreter started elsewhere than this tree's root).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
if [ -z "${PY:-}" ]; then
  PY=python3
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY=.venv/bin/python
  fi
fi
OUT=${OUT:-out}
mkdir -p "$OUT"
RESULTS="$OUT/gpu_check.jsonl"
: > "$RESULTS"
if ! "$PY" -c "import packkit.kernels" 2>/dev/null; then
  # pyproject.toml's SPDX license string needs setuptools >= 77; an image with an older one installs from
  # a folder whose pyproject.toml spells the license the older way (the code is this tree's, linked).
  if ! "$PY" -m pip install --quiet --no-deps --no-build-isolation --no-index -e . 2>/dev/null; then
    legacy=$(mktemp -d)
    sed -e 's/^license = "Apache-2.0"/license = { text = "Apache-2.0" }/' -e '/^license-files/d' \
        -e 's/"setuptools>=77"/"setuptools>=61"/' pyproject.toml > "$legacy/pyproject.toml"
    for d in packkit README.md LICENSE; do ln -s "$PWD/$d" "$legacy/$d"; done
    "$PY" -m pip install --quiet --no-deps --no-build-isolation --no-index -e "$legacy" \
      || { echo "could not install packkit into $PY"; exit 2; }
  fi
fi
# The compiled kernels, not the interpreter: the CPU Triton cases skip, the CUDA ones run.
unset TRITON_INTERPRET
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
# Compiled kernels and autotune timings (Triton's cache_results) cached on disk, shared by the parts.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/packkit-triton-cache}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  "$PY" -c "import transformers; print('transformers', transformers.__version__)" 2>/dev/null || echo "transformers: not installed"
  "$PY" -c "import flash_attn; print('flash-attn', flash_attn.__version__)" 2>/dev/null || echo "flash-attn: not installed"
  "$PY" -c "import inspect; from torch.nn.attention.varlen import varlen_attn; print('varlen_attn' + str(inspect.signature(varlen_attn)))" 2>/dev/null \
    || echo "torch.nn.attention.varlen.varlen_attn: not available"
} | tee "$OUT/gpu_env.txt"
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check here')" || exit 2

failed=()
run_part() {  # run_part NAME TIMEOUT_S COMMAND...: tee its output to $OUT/NAME.log, note a failure
  local name=$1 limit=$2; shift 2
  echo "== $name (timeout ${limit}s, $(( $(date +%s) - START ))s elapsed) =="
  timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $(( $(date +%s) - START ))s =="
  [ "$rc" -eq 0 ] || failed+=("$name(rc=$rc)")
}

run_part bench_attention 170 "$PY" benchmarks/bench_attention.py --reps 10 --json-out "$RESULTS"
PACKKIT_TRITON_AUTOTUNE=0 run_part cuda_tests 170 "$PY" -m pytest tests/test_attention.py tests/test_kernels_flash_varlen.py \
    tests/test_attention_hf.py -q -rs --durations=15 -p no:cacheprovider
run_part train_step 100 "$PY" benchmarks/bench_train_step.py --json-out "$RESULTS"
run_part kernel_resources 30 "$PY" benchmarks/kernel_resources.py --fixed --head-dims 64 128
# The resources table's JSON line, with the others.
tail -n 1 "$OUT/kernel_resources.log" | grep '^{' >> "$RESULTS" || true

echo "gpu_check: $(( $(date +%s) - START ))s; results in $RESULTS"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed parts: ${failed[*]}"
  exit 1
fi
echo "all parts passed"
