#!/usr/bin/env bash
# On a CUDA machine: the attention tests on the GPU (compiled Triton kernels, flash-attn and torch's
# varlen_attn where present), then the attention benchmark. Logs go to $OUT (or ./out) for RESULTS.md.
#   bash benchmarks/gpu_check.sh            # PY=... to choose the interpreter
# The interpreter: $PY, else .venv/bin/python when its torch sees CUDA, else python3 (on the lent GPU
# machines, the image's python3 holds a CUDA torch, Triton, pytest and hypothesis). packkit is
# installed into it from this tree (no dependencies, no index) when `packkit.kernels` is missing,
# since kernels/ only becomes packkit.kernels through the package's install.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  PY=python3
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY=.venv/bin/python
  fi
fi
OUT=${OUT:-out}
mkdir -p "$OUT"
if ! "$PY" -c "import packkit.kernels" 2>/dev/null; then
  "$PY" -m pip install --quiet --no-deps --no-build-isolation --no-index -e . || { echo "could not install packkit into $PY"; exit 2; }
fi
# The compiled kernels, not the interpreter: the CPU Triton cases skip, the CUDA ones run.
unset TRITON_INTERPRET
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  "$PY" -c "import flash_attn; print('flash-attn', flash_attn.__version__)" 2>/dev/null || echo "flash-attn: not installed"
} | tee "$OUT/gpu_env.txt"
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check here')" || exit 2

"$PY" -m pytest tests/test_attention.py tests/test_kernels_flash_varlen.py -q -rs --durations=15 -p no:cacheprovider \
    2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

"$PY" benchmarks/bench_attention.py 2>&1 | tee "$OUT/bench_attention.log"
bench_rc=${PIPESTATUS[0]}

echo "tests rc=$tests_rc bench rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
