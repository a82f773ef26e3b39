"""Where the memory that tokenizing frees goes: back to the system, not kept by the allocators.

:func:`bound_allocators` puts pyarrow's default pool on the system allocator for a command that tokenizes, and
:func:`release_freed` hands back what was freed and kept, once a chunk is tokenized. Measured with Qwen3's tokenizer
over 4 MB of ShareGPT text (``packkit pack``, peak ``RssAnon`` over the warm command,
``benchmarks/bench_text_memory.py``; ``benchmarks/RESULTS.md``): mimalloc, pyarrow's default pool, kept about 9 MiB
of pages after ``release_unused``. The tokenizer's worker threads each allocate in a glibc arena of their own, and
those arenas keep about 13 MiB after ``malloc_trim(0)`` (``MALLOC_ARENA_MAX=1`` in the environment removes it); one
arena for the process was measured 11-39% more CPU (its threads wait on one lock), so it is not set here.
"""

from __future__ import annotations

__all__ = ["bound_allocators", "c_getenv", "glibc", "release_freed"]

_GLIBC: list = []  # the C library once looked up when it is glibc (None: another C library)


def glibc():
    """The C library as a ``ctypes.CDLL`` when it is glibc (it has ``malloc_trim``), else None; looked up once."""
    if not _GLIBC:
        import ctypes

        try:
            libc = ctypes.CDLL(None)
        except (OSError, TypeError):  # no C library to load by name None (Windows)
            libc = None
        _GLIBC.append(libc if getattr(libc, "malloc_trim", None) is not None else None)
    return _GLIBC[0]


def c_getenv(name: str) -> str | None:
    """``name`` in the process's C environment, which Rust's ``std::env::var`` reads (``datasets``' ``map(num_proc)``
    sets ``TOKENIZERS_PARALLELISM`` there and hands Python a copy of ``os.environ`` without it), or ``os.environ``'s
    where the C library is not glibc."""
    import os

    libc = glibc()
    if libc is None:
        return os.environ.get(name)
    import ctypes

    getenv = libc.getenv
    getenv.restype, getenv.argtypes = ctypes.c_char_p, [ctypes.c_char_p]
    value = getenv(name.encode())
    return None if value is None else value.decode(errors="replace")


def bound_allocators(tokenizer) -> None:
    """pyarrow's default pool on the system allocator for the rest of the process (a command's own) when it
    tokenizes with ``tokenizer`` (None or ``"bytes"``: nothing changes): what the text chunks free goes back with
    :func:`release_freed`'s ``malloc_trim``, where mimalloc kept its pages after ``release_unused``."""
    if tokenizer in (None, "bytes"):
        return
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())


def release_freed() -> None:
    """Hand back to the system the memory freed but kept by the allocators: glibc's ``malloc_trim(0)`` and pyarrow's
    pool (``release_unused``: mimalloc keeps the pages of the chunks freed). Called once a tokenized chunk is made;
    16 calls took 30 ms in all for 4 MB of text. A no-op for glibc's part elsewhere."""
    import pyarrow as pa

    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)
    pa.default_memory_pool().release_unused()
