"""What many test files share (not a test module): tiny models built from a config, with random weights,
and real processes for the distributed tests.

Nothing is downloaded: every model here is a few thousand parameters, seeded, on the CPU.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing
import os
import socket
import sys
import threading
import time
import traceback

import pytest
import torch
from hypothesis import settings
import torch.multiprocessing as mp

# The shape every tiny transformer shares: 2 layers, hidden 32, 4 query heads over 2 kv heads (GQA).
TINY = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)

# family -> (model class, config class), as named in transformers.
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
    "cohere": ("CohereForCausalLM", "CohereConfig"),
    "mistral": ("MistralForCausalLM", "MistralConfig"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config"),
}


def tiny_config(family: str = "llama", **overrides):
    """The config of a tiny ``family`` model: :data:`TINY` with ``overrides`` on top.

    ``tiny_config(vocab_size=64).num_hidden_layers -> 2``
    """
    import transformers  # here, not at the top: the files that need no model need no transformers

    return getattr(transformers, FAMILIES[family][1])(**{**TINY, **overrides})


def tiny_causal_lm(family: str = "llama", *, dtype: torch.dtype = torch.float64, attn_implementation: str = "sdpa",
                   seed: int = 0, config=None, **overrides):
    """A tiny causal LM with random weights (``torch.manual_seed(seed)`` first), from :func:`tiny_config`
    (or from ``config``, a config object built by the caller), in train mode.

    ``tiny_causal_lm(vocab_size=64, dtype=torch.float32)`` -> a 2-layer LlamaForCausalLM, fp32, sdpa.
    """
    import transformers

    config = tiny_config(family, **overrides) if config is None else config
    cls = getattr(transformers, FAMILIES[family][0])
    torch.manual_seed(seed)
    return cls._from_config(config, attn_implementation=attn_implementation, dtype=dtype)


def tiny_token_lm(vocab: int, width: int, *, seed: int = 0) -> torch.nn.Module:
    """A per-token causal "LM" in float64: embedding -> tanh -> linear to the vocabulary; for loss tests,
    where attention is beside the point. ``tiny_token_lm(13, 6)(torch.tensor([[1, 2]])).shape -> (1, 2, 13)``.
    """
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, width), torch.nn.Tanh(), torch.nn.Linear(width, vocab)).double()


# -- vision-language: tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL and processor-like examples -----------------

#: special tokens of the tiny vision-language models (a vocabulary of 128; text ids are drawn below 100)
VL_TOKENS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
VL_MERGE = 2  # spatial_merge_size
VL_PATCH_DIM = 3 * 2 * 2 * 2  # channels * temporal_patch_size * patch_size**2

# family -> (model class, config class, vision config, extra text config, extra rope parameters)
VL_FAMILIES = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLConfig", dict(depth=1, embed_dim=16, hidden_size=32),
                 {}, {}),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig",
                   dict(depth=2, hidden_size=16, intermediate_size=32, out_hidden_size=32, window_size=8,
                        fullatt_block_indexes=[1]), {}, {}),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLConfig",
                 dict(depth=2, hidden_size=16, intermediate_size=32, out_hidden_size=32, num_position_embeddings=16,
                      deepstack_visual_indexes=[0]), {}, {"mrope_interleaved": True}),
    # hybrid too: a GatedDeltaNet layer, then an attention layer
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config",
                dict(depth=1, hidden_size=16, intermediate_size=32, out_hidden_size=32, num_position_embeddings=16),
                dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                     linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8),
                {"mrope_interleaved": True, "partial_rotary_factor": 1.0}),
}


def tiny_vl_model(family: str = "qwen2_vl", *, dtype: torch.dtype = torch.float64, seed: int = 0):
    """A tiny random mRoPE vision-language model (2 text layers of width 32, a 1-2 block vision tower
    that merges 2x2 patches of 2x2 pixels), sdpa, in eval mode. ``tiny_vl_model().config.image_token_id -> 120``.
    """
    import transformers

    model_cls, config_cls, vision, text, rope = VL_FAMILIES[family]
    text = dict(TINY, vocab_size=128, max_position_embeddings=256, head_dim=8, bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], **rope},
                **text)
    vision = dict(vision, num_heads=2, patch_size=2, spatial_merge_size=VL_MERGE, temporal_patch_size=2, in_channels=3)
    config = getattr(transformers, config_cls)(text_config=text, vision_config=vision, **VL_TOKENS)
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)._from_config(config, attn_implementation="sdpa", dtype=dtype).eval()


def vl_example(g: torch.Generator, text: int, images=(), videos=()) -> dict:
    """What a processor gives for one conversation: ``text`` text tokens (ids 1..99: 0 pads), then for every
    image (then video) grid ``(t, h, w)`` ``<vs> <im>*(t*h*w/4) <ve>`` and three text tokens;
    ``pixel_values``/``pixel_values_videos`` ``(t*h*w, VL_PATCH_DIM)`` float64, ``image_grid_thw``/``video_grid_thw``,
    ``mm_token_type_ids`` (1 image, 2 video), ``labels`` (-100 on vision tokens).
    ``len(vl_example(g, 2, images=[(1, 4, 4)])["input_ids"]) -> 11``.
    """
    ids = torch.randint(1, 100, (text,), generator=g).tolist()
    types = [0] * text
    ex = {}
    kinds = ((images, "image_token_id", 1, "pixel_values", "image_grid_thw"),
             (videos, "video_token_id", 2, "pixel_values_videos", "video_grid_thw"))
    for grids, token, kind, pixels, grid_key in kinds:
        for t, h, w in grids:
            n = t * h * w // VL_MERGE ** 2
            ids += [VL_TOKENS["vision_start_token_id"]] + [VL_TOKENS[token]] * n + [VL_TOKENS["vision_end_token_id"]]
            ids += torch.randint(1, 100, (3,), generator=g).tolist()
            types += [0] + [kind] * n + [0] * 4
        if grids:
            ex[pixels] = torch.cat([torch.randn(t * h * w, VL_PATCH_DIM, generator=g, dtype=torch.float64)
                                    for t, h, w in grids])
            ex[grid_key] = torch.tensor(grids)
    special = {VL_TOKENS[k] for k in VL_TOKENS}
    return {"input_ids": ids, "labels": [-100 if x in special else x for x in ids], "mm_token_type_ids": types, **ex}


def thorough() -> bool:
    """True under the ``thorough`` hypothesis profile (``make test-thorough``), where the sweeps too slow
    for ``make test`` run whole: ``thorough() -> False`` under ``ci``. Read it in the test, after
    conftest loaded the profile (a spawned process sees hypothesis' default profile)."""
    return settings.default.max_examples > settings.get_profile("dev").max_examples


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's ``init_method=tcp://127.0.0.1:PORT``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What the ranks' fork server imports once (see :func:`run_processes`).
PRELOAD = ["numpy", "torch", "torch.distributed", "torch.nn.parallel", "transformers.models.llama.modeling_llama",
           "packkit"]


def run_processes(worker, nprocs: int, args: tuple, *, timeout_s: float, start_method: str = "spawn",
                  preload: list[str] = PRELOAD) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` real processes and wait for them all; past ``timeout_s``
    seconds kill them and fail the test (a rank waiting on a collective another never reaches would
    otherwise hang the suite). An exception in a rank is raised here, with its traceback.

    The ranks are fresh interpreters (``spawn``: about 3-5 s of imports a rank on a 2-core machine).
    ``start_method="forkserver"`` forks them from one server per test process that imported ``preload``
    (:data:`PRELOAD`) once, which is faster, but it is not the default: under ``make test`` a 2-rank ``forkserver`` run of
    tests/test_groups_ddp.py once hung past its 120 s limit with nothing printed (1 of 5 whole-suite runs,
    2026-12-01; never alone), and ``spawn`` had run these tests without a hang since they were written."""
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(preload)  # no effect once this process's server runs
    ctx = mp.start_processes(_traced, args=(worker, max(timeout_s - 10, 1), *args), nprocs=nprocs, join=False,
                             start_method=start_method)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            try:
                _native_stacks([p.pid for p in ctx.processes if p.is_alive()])
            finally:  # py-spy failing or stuck must not leave the ranks running
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
            pytest.fail(f"the {nprocs}-process run did not finish in {timeout_s:g} s")


def py_spy() -> str | None:
    """The py-spy executable beside this interpreter (the test extra's) or on ``PATH``; None without it."""
    import shutil

    return shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")


def _native_stacks(pids: list[int]) -> None:
    """Every thread's native and Python stack of each process in ``pids``, to stderr, with py-spy (the test extra)
    where it is installed: faulthandler shows a rank's Python frames only, and a deadlock in a C++ destructor has
    none (the gloo one :func:`gloo_group` avoids was found this way)."""
    import subprocess

    spy = py_spy()
    for pid in pids if spy else []:
        done = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
        print(done.stdout, done.stderr, sep="\n", file=sys.stderr, flush=True)


def _traced(rank: int, worker, dump_after_s: float, *args):
    """``worker(rank, *args)`` in a rank of :func:`run_processes`, which writes every thread's stack to stderr (the
    test's captured output) if it is still running ``dump_after_s`` seconds in: a rank that hangs says where
    (a 2-rank run of test_prefixtree_ddp.py passed the 120 s limit once in a whole-suite run, 8 s alone)."""
    faulthandler.dump_traceback_later(dump_after_s)
    try:
        worker(rank, *args)
    finally:
        faulthandler.cancel_dump_traceback_later()
    # The rank's results are on disk and its group is destroyed: leave without the interpreter's teardown, where a
    # gloo object still held (DDP keeps its group) is freed while the runtime is going away. A rank of
    # test_loss_ddp.py aborted there once in CI (stop 45: "terminate called without an active exception", SIGABRT,
    # 1 of about 60 whole-suite runs). A rank that raised still exits through spawn, which reports its traceback.
    # What the teardown would have caught is checked here: a thread left running (packkit registers no atexit hook
    # and no finalizer) fails the rank, as the hang at exit it would have made failed the test.
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if left:  # raising would wait on them too, in spawn's exit
        print(f"rank {rank} returned with threads still running: {left}", file=sys.stderr, flush=True)
        os._exit(1)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


@contextlib.contextmanager
def gloo_group(rank: int, world: int, *, port: int | None, timeout_s: float):
    """One rank's gloo process group, one torch thread, for a worker of :func:`run_processes`: over
    ``tcp://127.0.0.1:port``, or ``env://`` (``MASTER_ADDR``/``MASTER_PORT``, set by the worker) when ``port`` is
    None. On a clean exit the ranks meet at a barrier before the group is destroyed, so that no rank closes its
    connections while another still has work in flight on them; on an exception it is destroyed at once (a barrier
    would wait for ranks that never come, until the group's timeout), and the ranks left at the barrier fail 5 s
    later, so that the rank that raised is the one :func:`run_processes` reports.

    Every group is kept referenced (:data:`_DESTROYED_GROUPS`) past its destruction, until the rank leaves by
    ``os._exit``: the last reference to a gloo group can be an object pybind frees with the GIL held (DDP's
    ``Reducer``), and the group's destructor then joins its worker threads while one of them may be waiting for the
    GIL to free a finished work's tensor: a deadlock (session 17's stop failed CI on it, see test_testlib_ranks;
    pytorch#56297)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://" if port is None else f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield
        try:
            dist.barrier()
        except RuntimeError:  # a rank left raising: let spawn report its traceback first, the cause
            time.sleep(5)
            raise
    finally:
        _DESTROYED_GROUPS.extend(dist.distributed_c10d._world.pg_map)
        dist.destroy_process_group()


_DESTROYED_GROUPS: list = []  # see gloo_group: never freed in a rank that passed, which leaves by os._exit


@contextlib.contextmanager
def gloo_rank(rank: int, port: int, world: int, out_dir: str, *, timeout_s: float):
    """One rank of a :func:`gloo_group` over ``tcp://127.0.0.1:port``: yields the list the worker fills with its
    results and saves it to ``out_dir/rank{rank}.pt``, or the traceback when the worker raises (re-raised).
    :func:`rank_results` reads them."""
    results: list = []
    path = os.path.join(out_dir, f"rank{rank}.pt")
    with gloo_group(rank, world, port=port, timeout_s=timeout_s):
        try:
            yield results
            torch.save({"results": results}, path)
        except Exception:
            torch.save({"error": traceback.format_exc()}, path)
            raise


def rank_results(out_dir, world: int) -> list:
    """Every rank's results saved by :func:`gloo_rank`, rank after rank; a rank's traceback fails the test."""
    results = []
    for rank in range(world):
        out = torch.load(os.path.join(out_dir, f"rank{rank}.pt"))
        assert "error" not in out, out.get("error")
        results += out["results"]
    return results
