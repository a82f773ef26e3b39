"""What every benchmark shares: the length distributions (real by default: :func:`add_lengths_option`), the
versions line, timing (A/B rounds alternated, garbage collected outside the clock, and the median and spread of
their pair ratios: :func:`ab_pairs`, :func:`rotating_rounds`, :func:`ratio_spread`), the verdict on a
target and the JSON line; for the GPU benchmarks, the --cpu-smoke / CUDA switch and its fakes.

Scripts run as ``python benchmarks/bench_<thing>.py``, so this module is importable as ``benchlib``.
torch is imported only by the helpers that need it.
"""

from __future__ import annotations

import gc
import importlib
import importlib.metadata
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import types

import numpy as np


def sft_like_lengths(n: int, *, seed: int = 0, median: int = 250, low: int = 8, high: int = 4096) -> np.ndarray:
    """(n,) int64 SFT-like lengths: lognormal with the given median, sigma 1, rounded, clipped to [low, high].

    SYNTHETIC: no comparison defaults to it (``tests/test_bench_rule.py``); a script offers it only behind
    ``--lengths sft-like`` (:func:`add_lengths_option`), labelled in its table. Real chat is far longer
    (median 1,697 tokens against 250: :func:`chat_lengths`), so figures taken on it do not carry over.
    ``sft_like_lengths(3, seed=0)`` -> e.g. ``[285, 223, 476]``.
    """
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), 1.0, n)), low, high).astype(np.int64)


CHAT_LENGTHS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sharegpt_qwen3_lengths.npy")


def chat_lengths(n: int | None = None, *, seed: int = 0, high: int | None = None) -> np.ndarray:
    """(n,) int64 real chat lengths: ShareGPT conversations under Qwen3's tokenizer.

    ``data/sharegpt_qwen3_lengths.npy`` holds 17,545 conversations (``make_chat_lengths.py`` says how
    it was made; median 1,697 tokens, 31% above 2,048, 0.35% above 4,096); ``n=None`` returns them in file
    order, a larger ``n`` draws with replacement (seeded), a smaller one without. ``high``: draw only from the
    conversations of at most ``high`` tokens (for a script whose examples must fit a window; none is clipped).
    """
    lengths = np.load(CHAT_LENGTHS).astype(np.int64)
    if high is not None:
        lengths = lengths[lengths <= high]
    if n is None:
        return lengths
    rng = np.random.default_rng(seed)
    return lengths[rng.choice(len(lengths), n, replace=n > len(lengths))]


CHAT_TURNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sharegpt_qwen3_training_turns.npz")


def chat_turns(n: int, *, seed: int = 0, high: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, loss)``, (n,) int64 each: real training samples, every assistant turn of the ShareGPT
    conversations with its history under Qwen3's tokenizer and TRL's training template (``make_turn_lengths.py``:
    67,608 samples), ``loss`` the assistant tokens of the turn (the completion, the sample's last tokens). Drawn
    as :func:`chat_lengths` draws; ``high`` as there."""
    with np.load(CHAT_TURNS) as z:
        lengths, loss = z["length"].astype(np.int64), z["loss"].astype(np.int64)
    keep = lengths <= (high if high is not None else lengths.max())
    lengths, loss = lengths[keep], loss[keep]
    pick = np.random.default_rng(seed).choice(lengths.size, n, replace=n > lengths.size)
    return lengths[pick], loss[pick]


def bench_turns(source: str, n: int, *, seed: int = 0, high: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, loss)`` of ``source`` (``--lengths``): ``"chat"`` -> :func:`chat_turns` (samples of at most ``high``
    tokens), ``"sft-like"`` -> ``packkit.budget.synthetic_sft_lengths`` (SYNTHETIC lognormal prompt and completion)."""
    if source == "chat":
        return chat_turns(n, seed=seed, high=high)
    if source == "sft-like":
        from packkit.budget import synthetic_sft_lengths

        return synthetic_sft_lengths(n, seed=seed, max_length=high)
    raise ValueError(f"unknown length source {source!r} for (length, loss) pairs; pass 'chat' or 'sft-like'")


LENGTH_SOURCES = {
    "chat": "real ShareGPT conversations under Qwen3's tokenizer (benchmarks/data)",
    "sft-like": "SYNTHETIC lognormal, median 250, sigma 1 (benchlib.sft_like_lengths; an explicit option only)",
    "uniform": "SYNTHETIC uniform 16..512 (benchlib.uniform_lengths; an explicit option only)",
}


def add_lengths_option(parser) -> None:
    """``--lengths {chat,sft-like}`` on ``parser``, real chat lengths by default: every comparison runs on real
    data unless the synthetic distribution is asked for by name (and then the table says so)."""
    parser.add_argument("--lengths", choices=list(LENGTH_SOURCES), default="chat",
                        help="length distribution: " + "; ".join(f"'{k}' {v}" for k, v in LENGTH_SOURCES.items())
                        + " (default: chat)")


def bench_lengths(source: str, n: int, *, seed: int = 0, high: int | None = None, median: int = 250) -> np.ndarray:
    """(n,) int64 lengths of ``source`` (``--lengths``): ``"chat"`` -> :func:`chat_lengths` (conversations of at most
    ``high`` tokens), ``"sft-like"`` -> :func:`sft_like_lengths` (``median``, clipped to ``high``), ``"uniform"`` ->
    :func:`uniform_lengths`."""
    if source == "chat":
        return chat_lengths(n, seed=seed, high=high)
    if source == "sft-like":
        return sft_like_lengths(n, seed=seed, median=median, **({} if high is None else {"high": high}))
    if source == "uniform":
        return uniform_lengths(n, seed=seed, **({} if high is None else {"high": min(high, 512)}))
    raise ValueError(f"unknown length source {source!r}; pass one of {sorted(LENGTH_SOURCES)}")


def gemma3_4b_config():
    """Gemma 3 4B's sizes (text 2,560 wide, 34 layers; SigLIP 1,152 wide, 27 layers, 896-pixel images of
    14-pixel patches), as a ``transformers.Gemma3Config`` only: no weights."""
    import transformers

    return transformers.Gemma3Config(
        text_config=dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=256),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, image_size=896,
                           patch_size=14))


def with_images(text: np.ndarray, window: int, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """VLM-like rows from text lengths: 0-4 images each (drawn from 0, 1, 1, 2, 3, 4), 256 placeholders and two
    markers an image as Gemma 3 lays them out; rows above ``window`` left out. ``(lengths, images)``."""
    images = np.random.default_rng(seed).choice([0, 1, 1, 2, 3, 4], size=text.size)
    lengths = text + images * 258
    keep = lengths <= window
    return lengths[keep], images[keep]


def uniform_lengths(n: int, *, seed: int = 0, low: int = 16, high: int = 512) -> np.ndarray:
    """(n,) int64 lengths uniform in [low, high]."""
    return np.random.default_rng(seed).integers(low, high + 1, n).astype(np.int64)


def versions(*packages: str) -> dict:
    """Machine and package versions, for the table header and the JSON line."""
    out = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    for name in ("numpy", "torch", *packages):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def best_of(fn, repeat: int):
    """``(seconds, result)``: the fastest of ``repeat`` calls of ``fn()``, garbage collected before each."""
    times, out = [], None
    for _ in range(repeat):
        gc.collect()
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def module_at(rev: str, path: str):
    """The module at ``path`` (``"packkit/balance.py"``) as it was at git revision ``rev``, for an A/B in one
    process: imported beside today's package (its relative imports resolve against today's modules), under the
    name ``<package>._at_<rev>_<module>``. ``module_at("5803dad", "packkit/balance.py").pack_to_cost``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = subprocess.run(["git", "-C", root, "show", f"{rev}:{path}"], check=True, capture_output=True,
                         text=True).stdout
    package, module = path[:-3].rsplit("/", 1)
    package = package.replace("/", ".")
    mod = types.ModuleType(f"{package}._at_{rev}_{module}")
    mod.__package__, mod.__file__ = package, f"{rev}:{path}"
    sys.modules[mod.__name__] = mod  # (dataclasses look their module up there)
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    return mod


def package_at(rev: str, module: str, package: str = "packkit"):
    """``package.module`` as it was at git revision ``rev``, with the whole package of that revision (its modules
    import each other, not today's), imported beside today's as ``<package>_at_<rev>.<module>`` from a temporary
    copy made by ``git archive``: an A/B of code that spans modules. ``package_at("aaf59a2", "cp").shard`` is that
    revision's ``shard`` with its own planner."""
    name = f"{package}_at_{rev}"
    if name not in sys.modules:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        tar = subprocess.run(["git", "-C", root, "archive", rev, package], check=True, capture_output=True).stdout
        where = tempfile.mkdtemp(prefix=f"{name}_")
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            t.extractall(where, filter="data")
        os.rename(os.path.join(where, package), os.path.join(where, name))
        sys.path.insert(0, where)
        try:
            importlib.import_module(name)
        finally:
            sys.path.remove(where)
    return importlib.import_module(f"{name}.{module}")


def ab_pairs(a, b, rounds: int, *, clock=time.perf_counter) -> tuple[list[float], list[float]]:
    """Seconds of ``a()`` and ``b()`` over ``rounds`` pairs, alternating (which runs first flips every round),
    garbage collected before each call and disabled during it: ``(times_a, times_b)``. ``clock``:
    ``time.process_time`` for the process's CPU time (every thread), which a loaded machine disturbs less."""
    ta, tb = [], []
    for r in range(rounds):
        for fn, out in ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta)):
            gc.collect()
            gc.disable()
            try:
                t = clock()
                fn()
                out.append(clock() - t)
            finally:
                gc.enable()
    return ta, tb


def best_interleaved(fns: dict, repeats: int, *, clock=time.perf_counter, setup=None) -> dict:
    """The least seconds of one call of each of ``fns`` (name -> callable) over ``repeats`` rounds, the rounds
    interleaved (round 1 of every callable, then round 2, ...) so a burst of load hits all of them, garbage
    collected before each call and disabled during it: ``{name: seconds}``. ``clock``: as :func:`ab_pairs`'.
    ``setup``: called before each call, off the clock (to undo what the last call left)."""
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if setup is not None:
                setup()
            gc.collect()
            gc.disable()
            try:
                t = clock()
                fn()
                best[name] = min(best[name], clock() - t)
            finally:
                gc.enable()
    return best


def parse_quick(parser, argv, what: str, **quick):
    """``parser``'s arguments from ``argv``, with a ``--quick`` switch (a smoke run: ``what``) that sets the
    fields of ``quick``: ``parse_quick(p, ["--quick"], "fewer rounds", rounds=3).rounds -> 3``."""
    parser.add_argument("--quick", action="store_true", help=f"{what} (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in quick.items():
            setattr(args, name, value)
    return args


def rotating_rounds(fns: dict, rounds: int, *, clock=time.process_time) -> dict:
    """Seconds of every callable of ``fns`` (name -> callable) over ``rounds`` rounds, one call of each a round, the
    order rotated every round (each goes first in turn), garbage collected before each call and disabled during it:
    ``{name: [seconds, ...]}``, round by round (the pairs of :func:`ratio_spread`)."""
    names = list(fns)
    out = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            gc.collect()
            gc.disable()
            try:
                t = clock()
                fns[name]()
                out[name].append(clock() - t)
            finally:
                gc.enable()
    return out


def ratio_spread(num, den) -> dict:
    """The pair ratios ``num[i] / den[i]``: median, lowest and highest, the middle half (``q1``, ``q3``: the
    quartiles), and the medians of each side. ``ratio_spread([2, 3], [1, 1]) -> {"median": 2.5, "low": 2.0,
    "high": 3.0, "q1": ..., "q3": ..., "num_median": 2.5, "den_median": 1, "pairs": 2}``."""
    r = [x / y for x, y in zip(num, den)]
    if not r:
        raise ValueError("ratio_spread of no pairs: measure at least one round")
    q = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else r * 3  # (inside low..high for 2 pairs)
    return {"median": statistics.median(r), "low": min(r), "high": max(r), "q1": q[0], "q3": q[2],
            "num_median": statistics.median(num), "den_median": statistics.median(den), "pairs": len(r)}


def spread_text(s: dict) -> str:
    """A :func:`ratio_spread` as a table cell: ``"1.52x (1.31-1.90, mid 1.45-1.60, 9 pairs)"``."""
    return (f"{s['median']:.2f}x ({s['low']:.2f}-{s['high']:.2f}, mid {s['q1']:.2f}-{s['q3']:.2f}, "
            f"{s['pairs']} pairs)")


def loadavg() -> float:
    """The 1-minute load average (``/proc/loadavg``; nan where there is none): written beside each figure."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return float("nan")


def median_time(fn, *, warmup: int, reps: int, device: str) -> float:
    """Median seconds per call of ``fn()`` after ``warmup`` untimed calls: CUDA events on "cuda" (the
    device time between the launch of the first kernel and the end of the last), perf_counter elsewhere."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def verdict(value: float | None, target: float, *, smoke: bool = False) -> str:
    """A measured ratio against its target (higher is better), as every benchmark words it.

    ``verdict(2.345, 2.0) -> "2.35x (met, target >= 2.00x)"``; ``verdict(1.5, 2.0) -> "1.50x (MISSED,
    target >= 2.00x)"``; ``"n/a"`` when nothing was measured, ``"n/a (smoke)"`` for a smoke run.
    """
    if smoke:
        return "n/a (smoke)"
    if value is None:
        return "n/a"
    return f"{value:.2f}x ({'met' if value >= target else 'MISSED'}, target >= {target:.2f}x)"


def emit_json(record: dict, path: str | None) -> None:
    """Print ``record`` as one JSON line, and append it to ``path`` (``--json-out``) at once, so that a
    run cut short keeps what it measured."""
    line = json.dumps(record)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def device_name(device: str) -> str:
    """The GPU's name on "cuda" (``torch.cuda.get_device_name()``), else the processor's."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    return platform.processor() or "cpu"


def smoke_or_cuda(script: str, *, smoke: bool) -> str | None:
    """The device a GPU benchmark runs on: "cpu" for ``--cpu-smoke`` (Triton under its interpreter, the
    CUDA-only attention backends faked by :func:`install_cpu_fakes`: every call path runs, nothing is
    measured), "cuda" when torch sees a GPU, else None after saying so on stderr (the script exits 2).
    Call it before anything imports ``packkit.kernels`` (Triton reads TRITON_INTERPRET then)."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        install_cpu_fakes()
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU (none found); run with --cpu-smoke to check the script on the CPU",
              file=sys.stderr)
        return None
    return "cuda"


def install_cpu_fakes() -> None:
    """--cpu-smoke: stand-ins for the CUDA-only backends, with their real signatures (flash-attn 2's
    flash_attn_varlen_func; torch 2.11's varlen_attn, which has no enable_gqa), computing through the
    reference, registered for CPU tensors through packkit.attention's public seam (register_kernel)."""
    from packkit import attention

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        assert cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k and dropout_p == 0.0
        return attention.reference_varlen_attention(q, k, v, cu_seqlens_q, max_seqlen_q, causal=causal,
                                                     scale=softmax_scale)

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1)):
        assert window_size in ((-1, 0), (-1, -1)) and return_aux is None
        return attention.reference_varlen_attention(query, key, value, cu_seq_q, max_q,
                                                     causal=window_size == (-1, 0), scale=scale)

    attention.register_kernel("flash_attn", flash_attn_varlen_func, devices=("cpu",))
    attention.register_kernel("torch", varlen_attn, devices=("cpu",))
