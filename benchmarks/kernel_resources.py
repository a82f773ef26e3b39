"""Registers, spills and shared memory of packkit's Triton kernels, compiled for sm_90 without a GPU.

For each autotune config of each kernel (``packkit.kernels.flash_varlen.CONFIGS``), at each head dim it
is listed for, Triton compiles the kernel for an sm_90 target (TTIR -> PTX -> cubin, with Triton's own
ptxas) and ``ptxas -v`` reports registers and spill stores; Triton's metadata gives the shared memory,
printed beside packkit's estimate (the bound the autotuner prunes with). A config that spills or whose
shared memory passes the estimate should leave its list. Nothing here needs a GPU.

    python benchmarks/kernel_resources.py                    # every config, d = 64 and 128
    python benchmarks/kernel_resources.py --fixed --head-dims 128 --dtype-class half

Prints a table, then one JSON line (the tests read it). Run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time


def ptxas_path() -> str | None:
    """The ptxas Triton compiles sm_90 with (its bundled one; which one depends on the release), else
    one on PATH."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(90).path
    except (ImportError, AttributeError, TypeError):
        return shutil.which("ptxas")


def ptxas_report(ptx: str, ptxas: str) -> dict:
    """Registers and spill bytes of one PTX module for sm_90a: ``{"registers": 168, "spill_bytes": 0}``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"ptxas failed: {run.stderr[-2000:]}")
    registers = re.search(r"Used (\d+) registers", run.stderr)
    spills = re.search(r"(\d+) bytes spill stores", run.stderr)
    return {"registers": int(registers.group(1)), "spill_bytes": int(spills.group(1)) if spills else 0}


def compile_for_sm90(kernel: str, dtype_class: str, config, head_dim: int, ptxas: str) -> dict:
    """Compile one (kernel, config) at one head dim for sm_90; return its resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from packkit.kernels import flash_varlen as fv

    jit = fv._JIT[kernel]
    element = "fp32" if dtype_class == "fp32" else "bf16"
    meta = dict(GROUP=4, HEAD_DIM=head_dim, IS_CAUSAL=True, DOT_PRECISION="ieee" if dtype_class == "fp32" else "tf32",
                UPCAST_DOT=False, DEVICE_COUNT=False, BLOCK_D=fv._head_block(head_dim), **config.kwargs)
    meta.update({"ATOMIC_DQ": kernel == "dkdv_atomic"} if kernel.startswith("dkdv") else {"REVERSE_GRID": True})
    names = list(inspect.signature(jit.fn).parameters)
    pointers = {"cu_seqlens_ptr": "*i32", "count_ptr": "*i32", "lse_ptr": "*fp32", "delta_ptr": "*fp32",
                "dq_acc_ptr": "*fp32"}
    signature = {n: "constexpr" if n in meta else pointers.get(n, "*" + element) if n.endswith("_ptr")
                 else "fp32" if n == "sm_scale" else "i32" for n in names}
    source = ASTSource(jit, signature, constexprs={(names.index(n),): v for n, v in meta.items()})
    start = time.perf_counter()
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    seconds = time.perf_counter() - start
    ptx = compiled.asm["ptx"]
    element_bytes = 4 if dtype_class == "fp32" else 2
    return dict(kernel=kernel, dtype_class=dtype_class, head_dim=head_dim,
                config=[config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages],
                shared=compiled.metadata.shared,
                shared_estimate=fv.shared_memory_estimate(kernel, config, fv._head_block(head_dim), element_bytes),
                wgmma="wgmma" in ptx, compile_s=round(seconds, 2), **ptxas_report(ptx, ptxas))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fixed", action="store_true", help="only the fixed configs (PACKKIT_TRITON_AUTOTUNE=0)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtype-class", choices=["half", "fp32"], nargs="+", default=["half", "fp32"])
    parser.add_argument("--kernels", nargs="+", default=["fwd", "dkdv", "dkdv_atomic", "dq"])
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("kernel_resources.py compiles the kernels: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    ptxas = ptxas_path()
    if ptxas is None:
        print("no ptxas found (Triton's bundled one or on PATH)", file=sys.stderr)
        return 2

    from packkit.kernels import flash_varlen as fv

    rows = []
    for (kernel, dtype_class), listed in fv.CONFIGS.items():
        if kernel not in args.kernels or dtype_class not in args.dtype_class:
            continue
        for config, max_d in listed[:1] if args.fixed else listed:
            for head_dim in args.head_dims:
                if fv._head_block(head_dim) <= max_d:
                    rows.append(compile_for_sm90(kernel, dtype_class, config, head_dim, ptxas))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    print(f"\n{'kernel':<12}{'class':<6}{'d':>4}  {'config (M, N, warps, stages)':<30}{'regs':>5}{'spill B':>9}"
          f"{'shared':>9}{'estimate':>10}  wgmma  compile s")
    for r in rows:
        print(f"{r['kernel']:<12}{r['dtype_class']:<6}{r['head_dim']:>4}  {str(tuple(r['config'])):<30}"
              f"{r['registers']:>5}{r['spill_bytes']:>9}{r['shared']:>9}{r['shared_estimate']:>10}  "
              f"{'yes' if r['wgmma'] else 'no':<5}  {r['compile_s']:>9}")
    import triton
    print(json.dumps(dict(bench="kernel_resources", triton=triton.__version__, target="sm_90a", rows=rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
