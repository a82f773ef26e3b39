"""Signals that end a run (Ctrl-C, ``kill``, a closed terminal), met so that the run ends cleanly.

Python turns SIGINT into ``KeyboardInterrupt`` between two bytecodes of the main thread, wherever that
is: inside a ``finally`` that removes a temporary file, or while the main thread waits for a writer
thread, whose file would then be closed under it (a crash in pyarrow: SIGSEGV or SIGABRT). Two rules
make any moment safe:

- **Cleanup and waiting run under** :func:`deferred`: a signal that arrives there is held and raised
  at the end of the block, once the thread has finished or the temporary file is gone::

      try:
          write(tmp)
      except BaseException:
          with deferred():            # a second Ctrl-C cannot leave tmp behind
              remove(tmp)
          raise

- **SIGTERM and SIGHUP** end the process without running any ``finally`` by default. Under
  :func:`signals_raise` (the ``packkit`` command runs inside it) they raise :class:`Interrupted`, a
  ``KeyboardInterrupt``, like SIGINT: every cleanup runs, and the command exits ``128 + signal``
  (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP).

Only the main thread can set handlers; elsewhere both are no-ops (signals are met by the main thread).
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import threading

__all__ = ["Interrupted", "STOP_SIGNALS", "signals_raise", "swallowed", "raise_swallowed", "forget_stops",
           "ending_cleanly", "deferred", "join"]

#: The signals that ask a run to stop (not SIGKILL, which nothing can meet).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived: ``Interrupted(signal.SIGTERM).exit_code -> 143``; caught wherever a
    ``KeyboardInterrupt`` is."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = int(signum)

    @property
    def name(self) -> str:
        """``SIGTERM``."""
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal: ``128 + signum``."""
        return 128 + self.signum


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


#: The stop signals raised as :class:`Interrupted` since the outermost :func:`signals_raise` began, oldest first.
_RAISED: list = []


def _raise(signum, frame):
    _RAISED.append(int(signum))
    raise Interrupted(signum)


def swallowed(error: BaseException) -> "Interrupted | None":
    """The first stop signal raised inside the current :func:`signals_raise` block, as the exception it raised,
    when ``error`` came in its stead, or None. A library that catches everything (fsspec's ``exists`` has a bare
    ``except:``) turns the stop into a failure of its own (``Unable to find '...'``), which would blame the input
    for the user's stop. An error raised while handling the stop (``error``'s chain holds it:
    :func:`packkit.fileio.held_still` turns the stop its lease break made into "IN was changed") is not one."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return None
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return Interrupted(_RAISED[0]) if _RAISED else None


def raise_swallowed() -> None:
    """Raise again the first stop signal raised as :class:`Interrupted` that the code it landed in swallowed, so that the
    run stops still: pyarrow's lazy ``import pandas`` (its first ``Array.to_numpy``) catches the exception a Ctrl-C
    raises there, and ``packkit pack`` went on to write OUT and exit 0. Called before an output is renamed into place
    and where :func:`signals_raise` ends; only while a block of this module raises them (stale ones are not met)."""
    if _RAISED and signal.getsignal(_RAISED[0]) is _raise:
        raise Interrupted(_RAISED[0])


def _unraisable(hook, unraisable) -> None:
    """``sys.unraisablehook`` inside :func:`signals_raise`: a stop raised in a finaliser (a ``__del__``, as in
    ``datasets.Dataset``'s) cannot leave it, and Python printed it as ``Exception ignored in ...`` with a traceback
    beside the command's one line. It is not printed: :func:`raise_swallowed` raises it again. Anything else goes to
    ``hook``."""
    if not isinstance(unraisable.exc_value, Interrupted):
        hook(unraisable)


def forget_stops() -> None:
    """Forget the stop signals raised so far: a read lease's break raises as Ctrl-C does
    (:func:`packkit.fileio.held_still`), and the error that says the input changed stands for it, not a stop."""
    _RAISED.clear()


def _install(signums, handler, old: dict) -> None:
    """Set ``handler`` for each of ``signums`` not ignored (``SIG_IGN``) or foreign (``None``), filing
    the handler it replaces in ``old`` (filled as it goes, so a caller's ``finally`` restores a partial
    install)."""
    for s in signums:
        current = signal.getsignal(s)
        if current is signal.SIG_IGN or current is None:
            continue
        old[s] = signal.signal(s, handler)


@contextlib.contextmanager
def signals_raise(signums=STOP_SIGNALS):
    """Inside, each of ``signums`` raises :class:`Interrupted` in the main thread (SIGTERM no longer
    ends the process before cleanup); the previous handlers are restored on exit. A signal ignored
    (``SIG_IGN``, e.g. SIGINT of a ``nohup`` job) stays ignored."""
    if not _main_thread():
        yield
        return
    old = {}
    outermost = signal.getsignal(signal.SIGTERM) is not _raise
    if outermost:
        _RAISED.clear()
        hook, sys.unraisablehook = sys.unraisablehook, functools.partial(_unraisable, sys.unraisablehook)
    try:
        _install(signums, _raise, old)
        yield
        if outermost:
            raise_swallowed()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if outermost:
            sys.unraisablehook = hook


@contextlib.contextmanager
def ending_cleanly(signums=STOP_SIGNALS):
    """Inside, a stop signal left at its default action (SIGTERM or SIGHUP in a program that calls packkit: the
    process ends at once and no ``finally`` runs) raises :class:`Interrupted`, so that the block's cleanup runs;
    when the block ends on it, the default action is put back and the signal raised again: the process ends by
    that signal, as it would have, with nothing left behind. A signal with a handler (SIGINT's
    ``KeyboardInterrupt``, :func:`signals_raise`, the program's own) is left as it is; nested blocks act for the
    outermost (an inner one finds the handler set)."""
    if not _main_thread():
        yield
        return
    old = {}
    try:
        _install([s for s in signums if signal.getsignal(s) is signal.SIG_DFL], _raise, old)
        yield
    except Interrupted as exc:
        if exc.signum in old:
            for s, handler in old.items():
                signal.signal(s, handler)
            old.clear()
            signal.raise_signal(exc.signum)  # the default action: the process ends here
        raise
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def deferred(signums=STOP_SIGNALS):
    """Hold the stop signals that arrive inside the block; raise the first of them at its end.

    The held signal is raised again with the handler that was in place (an exception for SIGINT, or
    under :func:`signals_raise`; the default action otherwise, e.g. SIGTERM ending a library user's
    process, after the block). Nested blocks hold for the outermost.
    """
    if not _main_thread():
        yield
        return
    held: list = []
    old = {}
    try:
        _install(signums, lambda signum, frame: held.append(signum), old)
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if held:
            signal.raise_signal(held[0])


def join(thread: threading.Thread) -> None:
    """``thread.join()`` that a signal cannot cut short (it is held until the thread has ended): the
    caller never closes a file a thread still writes."""
    with deferred():
        thread.join()
