"""Files in and out. In: the input files held still while packkit reads them (:func:`held_still`, here). Out: every
file or folder packkit writes is written whole or not at all, and nothing of the user's is lost (:mod:`packkit.atomic`,
whose every name this module lends under its old address, ``packkit.fileio.atomic_output``): a room of its own, so
that a command that reads a file and writes none (``packkit plan FILE``, ``waste FILE``) does not compile the output
side.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import threading
from pathlib import Path

from .errors import DataError
from .interrupts import deferred, forget_stops

__all__ = ["OutputError", "OutputExistsError", "MissingFolderError", "InputChangedError", "atomic_output",
           "check_output", "fsync_tree", "held_still", "temp_folder", "temp_sibling", "TMP_MARK", "TMP_PATTERN",
           "name_max", "named_os_error", "png_figure", "check_plot", "PLOT_SUFFIX"]
#: The names :mod:`packkit.atomic` holds (its ``__all__``), lent here.
_OUTPUT_SIDE = frozenset(__all__) - {"InputChangedError", "held_still"}


def _atomic():
    """:mod:`packkit.atomic`, imported where an output is checked or written: a command that writes nothing does not
    compile it."""
    from . import atomic  # lazy: the output side, for a command that writes (or checks) a file
    return atomic


def __getattr__(name: str):
    """The names of :mod:`packkit.atomic` (the output side), lent under their old address (``fileio.atomic_output``)."""
    if name in _OUTPUT_SIDE:
        return getattr(_atomic(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------
# inputs held still while they are read
# ----------------------------------------------------------------------------------------------


class InputChangedError(DataError):
    """An input file was written, truncated or replaced in place while packkit read it (a ``DataError``)."""


def _input_files(paths) -> list:
    """The regular files of ``paths`` (a folder stands for every file in it, at any depth), each once."""
    out, seen = [], set()
    for p in paths:
        p = Path(p)
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                key = os.path.realpath(f)
                if key not in seen:
                    seen.add(key)
                    out.append(f)
    return out


def _stamp(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class _Hold:
    """What :func:`held_still` holds: a read lease per file where the kernel grants one, else the file's stamp."""

    def __init__(self, files):
        self.files = list(files)
        self.fds: dict = {}      # path -> fd holding a read lease
        self.stamps: dict = {}   # path -> (dev, inode, size, mtime) of the files read without a lease
        self.broken: list = []   # the leased files another process opened to write
        self.done = False        # read to the end (:meth:`release`): a change after it changes nothing read

    def changed(self) -> Path | None:
        """The first file that another process is changing (a lease broken) or changed (its stamp), or None."""
        if self.broken:
            return self.broken[0]
        for path, stamp in self.stamps.items():
            try:
                if _stamp(os.stat(path)) != stamp:
                    return path
            except OSError:
                return path
        return None

    def check(self) -> None:
        """Raise :class:`InputChangedError` naming the file if one changed since it was first read."""
        if self.done:
            return
        path = self.changed()
        if path is not None:
            raise _changed_error(path)

    def release(self) -> None:
        """The reader is done with the files: :meth:`check` a last time, then let go of the leases, so that a
        writer waiting on them goes on at once and the output, made whole from unchanged files, is kept.
        Before, a writer that came after the last read but before the output was renamed into place ended the
        run with "nothing was written" while the output stood complete."""
        self.check()  # a break before this line stops the run as ever: nothing is written
        self.done = True  # from here the SIGIO handler lets a break pass
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


def _changed_error(path) -> InputChangedError:
    forget_stops()  # the lease's break raised as Ctrl-C does: this error says it, not "interrupted"
    return InputChangedError(f"{str(path)!r} was changed while packkit read it (written, truncated or replaced in "
                             "place by another program); nothing was written: run again once it is complete, or copy "
                             "it and read the copy")


def _lease(path: Path):
    """``(fd, None)`` holding a read lease on ``path``, or ``(None, errno)`` where the kernel grants none."""
    import fcntl

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        os.close(fd)
        return None, exc.errno
    return fd, None


@contextlib.contextmanager
def held_still(paths):
    """Inside, the input files ``paths`` (a folder: every file in it) may not change under the reader.

    Arrow inputs are memory-mapped: a page read after another process truncated the file is a SIGBUS, which
    kills the process with nothing printed and its temporary files left beside the output. No check before
    and after a read closes that race (the file can shrink between the check and the page), and a SIGBUS
    cannot be caught from Python (its handler runs after the faulting instruction, which faults again). So
    each file is held with a **read lease** (Linux ``fcntl(F_SETLEASE, F_RDLCK)``): another process that
    opens it to write, or truncates it, waits in the kernel while this one is told (SIGIO); the signal stops
    the run as Ctrl-C does (every temporary file removed, threads joined: :mod:`packkit.interrupts`), and the
    block raises :class:`InputChangedError` naming the file (in place of whatever ended the run: a library that
    swallows the stop fails in its stead), never "interrupted"; the leases go last, so the writer proceeds only
    once nothing reads the map. The kernel waits ``/proc/sys/fs/lease-break-time`` seconds (45 by default)
    for that, far more than a stop takes.

    Where the kernel grants no lease (the file is open for writing somewhere, this process included: a
    pyarrow writer given a path keeps its file open until collected; a file of another user; a file system
    without leases; not Linux; not the main thread), the file's size, inode and modification time are compared
    at each :meth:`check` and at the end, and a change is the same error; a truncation there can still end
    in SIGBUS.

    Yields the hold: ``hold.check()`` raises if a file changed (:class:`InputChangedError`).
    """
    hold = _Hold(_input_files(paths))
    main = threading.current_thread() is threading.main_thread()
    use_leases = main and hasattr(signal, "SIGIO") and _leases_possible()
    previous = None
    if use_leases:
        def on_break(signum, frame):
            if hold.done:  # the leases are let go (a signal already on its way): nothing read is changed
                if callable(previous):
                    previous(signum, frame)
                return
            for path, fd in list(hold.fds.items()):
                try:
                    import fcntl

                    breaking = fcntl.fcntl(fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK
                except OSError:
                    breaking = False
                if breaking and path not in hold.broken:
                    hold.broken.append(path)
            if hold.broken:  # stop as Ctrl-C stops (held where cleanup runs: packkit.interrupts.deferred)
                stop = signal.getsignal(signal.SIGINT)
                (stop if callable(stop) else signal.default_int_handler)(signal.SIGINT, frame)
            elif callable(previous):
                previous(signum, frame)

        previous = signal.signal(signal.SIGIO, on_break)
    try:
        for path in hold.files:
            fd, err = _lease(path) if use_leases else (None, None)
            if fd is not None:
                hold.fds[path] = fd
                continue
            hold.stamps[path] = _stamp(os.stat(path))
        yield hold
        hold.check()
    except BaseException:  # the break's stop, or the error of a library that swallowed it (pyarrow's import pandas)
        if hold.broken:
            raise _changed_error(hold.broken[0]) from None
        raise
    finally:
        if use_leases:
            with deferred():  # released before the SIGIO handler goes: its default action ends the process
                signal.signal(signal.SIGIO, signal.SIG_IGN)
                for fd in hold.fds.values():
                    with contextlib.suppress(OSError):
                        os.close(fd)
                signal.signal(signal.SIGIO, previous if previous is not None else signal.SIG_DFL)


@functools.cache
def _leases_possible() -> bool:
    """Linux with leases enabled (``/proc/sys/fs/leases-enable``)."""
    try:
        import fcntl

        fcntl.F_SETLEASE  # noqa: B018 - Linux only
    except (ImportError, AttributeError):
        return False
    try:
        with open("/proc/sys/fs/leases-enable") as f:
            return f.read().strip() != "0"
    except OSError:
        return True
