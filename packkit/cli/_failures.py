"""What the ``packkit`` command says when it fails: an error a user can cause as an exit code and one line
(:func:`classify`, :func:`install_hint`), a stop signal (:func:`stopped`), a closed output pipe (:func:`pipe_closed`).
Imported where a command fails, not at its start."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import sys

from ..interrupts import Interrupted
from ._exits import EXIT_BROKEN_PIPE, EXIT_DATA, EXIT_INTERRUPTED, EXIT_SYSTEM, EXIT_USAGE, UsageError

_SYSTEM_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS, errno.EMFILE, errno.ENFILE,
                  errno.ENOMEM, errno.EACCES, errno.EPERM}


def install_hint(exc: ImportError) -> str:
    """``No module named 'datasets'`` -> ``...: pip install 'packkit[datasets]'`` (the extra that holds the
    module, from packkit's own metadata), unless the message already says what to install."""
    text, module = str(exc), (getattr(exc, "name", None) or "").split(".")[0]
    if "pip install" in text or not module:
        return text
    extra = _extra_for(module)
    return f"{text}: pip install " + (f"'packkit[{extra}]'" if extra else module.replace("_", "-"))


def _extra_for(module: str) -> str | None:
    """The smallest user extra of packkit that installs ``module`` (``test`` and ``bench`` last)."""
    try:
        from importlib.metadata import requires
        reqs = requires("packkit") or []
    except Exception:  # not installed as a distribution (a source tree on sys.path)
        return None
    want, found = module.lower().replace("-", "_"), {}  # found: {extra: how many packages it installs}
    for req in reqs:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+).*extra\s*==\s*['\"]([^'\"]+)['\"]", req)
        if m and m.group(1).lower().replace("-", "_") == want:
            extra = m.group(2)
            found[extra] = sum(1 for r in reqs if re.search(r"extra\s*==\s*['\"]%s['\"]" % re.escape(extra), r))
    return min(found, key=lambda e: (e in ("test", "bench"), e != want, found[e], e)) if found else None


def classify(exc: BaseException, options: dict | None = None) -> tuple[int, str] | None:
    """``(exit code, one-line message)`` for an error a user can cause; None for a bug (re-raised)."""
    from ..errors import ArgumentError, OutputError, PackkitError  # lazy: for an error only (not at --help)
    if isinstance(exc, UsageError):
        return EXIT_USAGE, str(exc)
    if isinstance(exc, PackkitError):
        code = EXIT_USAGE if isinstance(exc, (ArgumentError, OutputError)) else EXIT_DATA
        return code, exc.render(options)
    if isinstance(exc, MemoryError):
        detail = str(exc) or "an allocation failed"
        return EXIT_SYSTEM, f"out of memory ({detail}); free memory, or process a smaller input"
    if isinstance(exc, ImportError) and ((exc.name or "").split(".")[0] not in ("", "packkit")
                                         or "pip install" in str(exc)):
        return EXIT_SYSTEM, install_hint(exc)  # an ImportError inside packkit is a bug: re-raised
    if isinstance(exc, OSError):
        named = exc.errno is not None and exc.strerror and exc.filename is not None
        text = f"{exc.filename!s}: {exc.strerror}" if named else str(exc)
        if exc.errno in _SYSTEM_ERRNOS:
            return EXIT_SYSTEM, text
        return (EXIT_USAGE if isinstance(exc, FileExistsError) else EXIT_DATA), text
    if isinstance(exc, KeyError):
        return EXIT_DATA, str(exc.args[0]) if exc.args else "missing key"
    if isinstance(exc, (ValueError, TypeError)) or type(exc).__module__.startswith("pyarrow"):
        return EXIT_DATA, str(exc)
    return None


def pipe_closed() -> int:
    """After a broken pipe: stdout pointed at /dev/null so that the flush at exit cannot fail again; the exit code."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # stdout is not a real file (captured in tests)
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    return EXIT_BROKEN_PIPE


def stopped(name: str, exc: KeyboardInterrupt) -> int:
    """Say that a stop signal ended the command, in one line; its exit code (130 for Ctrl-C, 128 + signum)."""
    if os.environ.get("PACKKIT_DEBUG"):
        raise exc
    stopped = isinstance(exc, Interrupted) and exc.signum != signal.SIGINT
    with contextlib.suppress(OSError, ValueError):
        print(f"packkit {name}: " + (f"stopped by {exc.name}" if stopped else "interrupted"), file=sys.stderr)
    return exc.exit_code if stopped else EXIT_INTERRUPTED
