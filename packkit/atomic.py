"""Writing files and folders so that nobody ever sees half of one, and nothing of the user's is lost.

Every file or folder packkit writes goes through :func:`atomic_output`: the writer fills a temporary
path *beside* the target (same folder, so the same file system), the result is flushed to disk
(``fsync``), and only then renamed over the target, in one step. Killed at any moment, the target
holds its previous complete content or does not exist, never a short file under the target's name.

Every temporary file or folder packkit makes is named ``.NAME.packkit-tmp-XXXXXXXX`` (:data:`TMP_PATTERN`:
a dot, NAME, ``.packkit-tmp-``, 8 hex digits) beside what it is for: NAME is the target's name, cut
short where the whole would pass the file system's limit (``NAME_MAX``, 255 bytes), or ``staged`` for
input staged beside the output (:mod:`packkit.sources`). It is removed on any error and on SIGINT,
SIGTERM and SIGHUP (:mod:`packkit.interrupts`; in a program that calls packkit and leaves SIGTERM at its
default, the file is removed and then the process ends by the signal); only SIGKILL or a crash can leave one::

    with atomic_output("packed.parquet", inputs=["data.parquet"]) as tmp:
        pyarrow.parquet.write_table(table, tmp)     # tmp: a path that does not exist yet
    # packed.parquet is complete here; on an exception it is as it was before

Before anything is written, :func:`check_output` refuses what would destroy the user's data:

========================================  =====================================================
target                                    outcome (every one an ``OutputError``, a ``ValueError``)
========================================  =====================================================
exists, ``overwrite=False``               ``OutputExistsError`` (also a ``FileExistsError``):
                                          replaced only when asked
the same file as an input                 ``OutputError`` (``os.path.samefile``: hard and
                                          symbolic links included)
a folder that contains an input           ``OutputError`` (writing it would replace the input)
a folder where a file is written, or the  ``OutputError``, even with ``overwrite``
other way round
a named pipe, a socket or a device        ``OutputError``, even with ``overwrite`` (renamed over,
                                          it would be replaced, never written through)
parent folder missing                     ``MissingFolderError`` (also a ``FileNotFoundError``)
                                          unless ``parents=True``
parent folder not writable                ``OutputError``
a name longer than the file system        ``OutputError``: refused before any work, not after
allows, or a path that is not UTF-8       (pyarrow opens files by UTF-8 paths)
========================================  =====================================================

Renames use Linux's ``renameat2`` where it exists: ``RENAME_NOREPLACE`` so that a target that
appeared meanwhile is never clobbered without ``overwrite``, and ``RENAME_EXCHANGE`` to swap a new
folder with an old one in one step (the old one is deleted afterwards). Elsewhere a file is placed
with ``os.link`` (which refuses an existing target) or ``os.replace``, and a folder by two renames
(between them the target is briefly absent, never partial).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import secrets
import shlex
import shutil
import signal
import threading
from pathlib import Path

from .errors import ArgumentError, DataError, OutputError, arg
from .interrupts import deferred, ending_cleanly, raise_swallowed

__all__ = ["OutputError", "OutputExistsError", "MissingFolderError", "atomic_output", "check_output", "fsync_tree",
           "temp_folder", "temp_sibling", "TMP_MARK", "TMP_PATTERN", "name_max", "named_os_error", "png_figure",
           "check_plot", "PLOT_SUFFIX"]

#: Marks the temporary files and folders written beside a target (``.NAME.packkit-tmp-XXXXXXXX``).
TMP_MARK = ".packkit-tmp-"
#: Every temporary name packkit makes: ``TMP_PATTERN.fullmatch(".out.parquet.packkit-tmp-1a2b3c4d")``.
TMP_PATTERN = re.compile(r"\..*" + re.escape(TMP_MARK) + r"[0-9a-f]{8}", re.DOTALL)


class OutputExistsError(OutputError, FileExistsError):
    """The target exists and ``overwrite`` was not given (a ``FileExistsError`` and an :class:`OutputError`)."""


class MissingFolderError(OutputError, FileNotFoundError):
    """The folder the target would go in does not exist, and ``parents`` was not given."""


def _exists_error(target: Path, overwrite_hint: str | None) -> OutputExistsError:
    return OutputExistsError("{target} exists; pass {hint} to replace it", target=repr(str(target)),
                             hint=arg("overwrite", True) if overwrite_hint is None else overwrite_hint)


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------


def _same(a: Path, b: Path) -> bool:
    """``a`` and ``b`` are the same existing file or folder (by inode: links included)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _contains(folder: Path, path: Path) -> bool:
    """``folder`` (an existing folder) holds ``path``, at any depth, by inode and by resolved path."""
    for parent in Path(os.path.abspath(path)).parents:
        if _same(parent, folder):
            return True
    try:
        return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))
    except (OSError, ValueError):
        return False


def check_output(target, *, kind: str = "file", inputs=(), overwrite: bool = False, parents: bool = False,
                 overwrite_hint: str | None = None) -> Path:
    """``target`` as a ``Path`` once it is safe to write there (the table in the module docstring).

    Args:
        target: the file or folder to write.
        kind: ``"file"`` or ``"dir"``: what will be written.
        inputs: paths being read (files or folders); the target may be none of them and hold none.
        overwrite: an existing target may be replaced (by one of the same kind).
        parents: create missing parent folders (else their absence is an error).
        overwrite_hint: how the caller spells ``overwrite`` in the error text; default
            ``overwrite=True``, which the ``packkit`` command renders as ``--overwrite``.

    Every refusal is an :class:`~packkit.errors.OutputError` (a ``ValueError``): ``OutputExistsError`` is
    also a ``FileExistsError``, ``MissingFolderError`` a ``FileNotFoundError``.
    """
    if kind not in ("file", "dir"):
        raise ValueError(f"kind must be 'file' or 'dir', got {kind!r}")
    target = Path(target)
    if target.name in ("", ".", ".."):
        raise ValueError(f"{str(target)!r} names no file or folder to write; give a name")
    check_name(target)
    for src in inputs:
        src = Path(src)
        if _same(src, target) or (not os.path.lexists(target)
                                  and os.path.realpath(src) == os.path.realpath(target)):
            raise OutputError(f"{str(target)!r} is the input {str(src)!r} (the same file); write the output "
                              "elsewhere")
        if target.is_dir() and _contains(target, src):
            raise OutputError(f"{str(target)!r} is a folder that holds the input {str(src)!r}; writing it "
                              "would replace the input: write the output elsewhere")
    if os.path.lexists(target):
        special = _special_file(target)
        if special:
            raise OutputError(f"{str(target)!r} is {special}, not a file: packkit writes beside it and renames the "
                              "result into place, which would put a file where it is and write nothing through it; "
                              "give the name of a file to write")
        if target.is_dir() != (kind == "dir"):
            have, want = ("a folder", "a file") if target.is_dir() else ("a file", "a folder")
            raise OutputError(f"{str(target)!r} is {have}, and the output is {want}; remove it or choose "
                              "another name")
        if not overwrite:
            raise _exists_error(target, overwrite_hint)
    parent = target.parent
    if not parent.is_dir():
        if parents and not parent.exists():
            parent.mkdir(parents=True, exist_ok=True)
        elif parent.exists():
            raise OutputError(f"{str(parent)!r} is not a folder, so {str(target)!r} cannot be written")
        else:
            raise MissingFolderError(f"folder {str(parent)!r} does not exist; create it first "
                                     f"(mkdir -p {shlex.quote(str(parent))})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"folder {str(parent)!r} is not writable, so {str(target)!r} cannot be written there")
    return target


def _special_file(path: Path) -> str | None:
    """What ``path`` is when it is neither a file nor a folder (a named pipe, a socket, a device), else None:
    ``_special_file(Path("/dev/null")) -> "a character device"``."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:  # a dangling symbolic link: replaced as a file is
        return None
    for test, name in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return None


def name_max(folder) -> int:
    """The longest file name, in bytes, the file system of ``folder`` takes (``NAME_MAX``; 255 where it
    cannot be asked): ``name_max("/tmp") -> 255``."""
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return 255


def check_name(target) -> None:
    """Refuse a target whose name the file system, or pyarrow, cannot take, before any work:
    ``check_name("o" * 300 + ".parquet")`` raises ``OutputError`` (the name is 308 bytes, 255 at most)."""
    target = Path(target)
    try:
        str(target).encode("utf-8")
    except UnicodeEncodeError:
        raise OutputError(f"{str(target)!r} is not a UTF-8 path (pyarrow, which writes the output, takes only "
                          "UTF-8 paths); choose a UTF-8 name") from None
    folder = target.parent if target.parent.is_dir() else Path(".")
    size, most = len(os.fsencode(target.name)), name_max(folder)
    if size > most:
        raise OutputError(f"{str(target)!r}: its name is {size:,} bytes, longer than the file system takes "
                          f"({most:,}); choose a shorter name")


def named_os_error(exc: OSError, path) -> OSError:
    """``exc`` naming ``path`` when it names no file (pyarrow's write errors don't):
    ``named_os_error(OSError(28, "...No space left on device"), "out.parquet").filename -> "out.parquet"``.
    The errno is read from pyarrow's ``[errno N]`` text when the exception lacks it."""
    if exc.filename is not None:
        return exc
    code = exc.errno
    if code is None:
        m = re.search(r"\[errno (\d+)\]", str(exc), re.IGNORECASE)
        code = int(m.group(1)) if m else None
    if code is None:
        return exc
    return OSError(code, os.strerror(code), str(path))  # OSError picks the subclass of the errno


# ----------------------------------------------------------------------------------------------
# flushing and renaming
# ----------------------------------------------------------------------------------------------


def _fsync_path(path: Path, *, directory: bool) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # pragma: no cover - e.g. folders that cannot be opened on some platforms
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # pragma: no cover - fsync of a folder is refused on some file systems
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.EROFS):
            raise
    finally:
        os.close(fd)


def fsync_tree(path) -> None:
    """Flush ``path`` to disk: a file, or a folder with every file and folder in it."""
    path = Path(path)
    if not path.is_dir():
        _fsync_path(path, directory=False)
        return
    for root, dirs, files in os.walk(path):
        for name in files:
            _fsync_path(Path(root) / name, directory=False)
        _fsync_path(Path(root), directory=True)


def temp_name(name: str, *, limit: int = 255) -> str:
    """A fresh temporary name for ``name`` of at most ``limit`` bytes (:data:`TMP_PATTERN`):
    ``temp_name("out.parquet") -> ".out.parquet.packkit-tmp-1a2b3c4d"``; a name within 22 bytes of the
    limit is cut (at a character boundary) so that the temporary one still fits."""
    tail = f"{TMP_MARK}{secrets.token_hex(4)}"
    room = max(limit - 1 - len(tail), 1)
    raw = os.fsencode(name)
    if len(raw) > room:
        name = raw[:room].decode("utf-8", "ignore") or "x"
    return f".{name}{tail}"


def temp_sibling(target) -> Path:
    """A fresh path beside ``target`` that does not exist: ``out.parquet -> .out.parquet.packkit-tmp-1a2b3c4d``
    (:func:`temp_name`: no longer than the file system's limit)."""
    target = Path(target)
    limit = name_max(target.parent if target.parent.is_dir() else Path("."))
    while True:
        tmp = target.with_name(temp_name(target.name, limit=limit))
        if not os.path.lexists(tmp):
            return tmp


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
#: What ``renameat2`` answers where the kernel or the file system lacks it: fall back to portable renames.
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EINVAL),
                getattr(errno, "EOPNOTSUPP", errno.EINVAL)}
_AT_FDCWD = -100


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux ``renameat2``; False where it is unavailable (other systems, old kernels or file systems)."""
    func = _libc_renameat2()
    if func is None:
        return False
    if func(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(dst))


@functools.cache
def _libc_renameat2():
    """libc's ``renameat2`` (looked up once), or None where libc has none."""
    import ctypes.util  # imports subprocess and socket (16 ms of the CLI's start): only when a rename asks

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        func = libc.renameat2
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


def _remove(path: Path) -> None:
    """Remove a temporary file or folder; never fails (a cleanup error must not hide the real one)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _place(tmp: Path, target: Path, *, overwrite: bool, overwrite_hint: str | None) -> None:
    """Rename the complete ``tmp`` to ``target``: never over an existing target unless ``overwrite``."""
    if not overwrite:
        try:
            if _renameat2(tmp, target, _RENAME_NOREPLACE):
                return
        except FileExistsError:
            raise _exists_error(target, overwrite_hint) from None
        if tmp.is_dir():
            if os.path.lexists(target):
                raise _exists_error(target, overwrite_hint)
            os.rename(tmp, target)
            return
        try:
            os.link(tmp, target)  # refuses an existing target
        except FileExistsError:
            raise _exists_error(target, overwrite_hint) from None
        except OSError:  # no hard links here (some network or FAT file systems)
            if os.path.lexists(target):
                raise _exists_error(target, overwrite_hint) from None
            os.rename(tmp, target)
            return
        tmp.unlink()
        return
    if not tmp.is_dir() or not os.path.lexists(target):
        os.replace(tmp, target)  # a file over a file, or a folder where there is none: one step
        return
    if _renameat2(tmp, target, _RENAME_EXCHANGE):  # swap the folders in one step; tmp now holds the old one
        _remove(tmp)
        return
    old = temp_sibling(target)
    os.rename(target, old)
    os.rename(tmp, target)
    _remove(old)


@contextlib.contextmanager
def temp_folder(target):
    """A fresh folder beside ``target`` (:func:`temp_sibling`: ``.NAME.packkit-tmp-XXXXXXXX``) for the run's own
    files, removed when the block ends, however it ends (a stop signal's removal held until done)."""
    folder = temp_sibling(target)
    try:
        with deferred():  # a stop signal between the folder's making and the try would leave it
            folder.mkdir()
        yield folder
    finally:
        with deferred():
            _remove(folder)


@contextlib.contextmanager
def atomic_output(target, *, kind: str = "file", inputs=(), overwrite: bool = False, parents: bool = False,
                  overwrite_hint: str | None = None):
    """Write ``target`` through a temporary path beside it; yields that path (it does not exist yet).

    On a normal exit the temporary file or folder is flushed to disk and renamed over ``target`` in one
    step (then the folder holding it is flushed too); on an exception (a ``KeyboardInterrupt`` included)
    it is removed and ``target`` is untouched. A stop signal during the rename or the removal is held
    until it is done (:func:`packkit.interrupts.deferred`). An ``OSError`` that names no file (pyarrow's
    "No space left on device") is raised naming ``target``. The arguments are :func:`check_output`'s,
    checked before the writer runs and again, for an existing target, at the rename.
    """
    target = check_output(target, kind=kind, inputs=inputs, overwrite=overwrite, parents=parents,
                          overwrite_hint=overwrite_hint)
    tmp = temp_sibling(target)
    with ending_cleanly():  # SIGTERM in a program that calls packkit: tmp removed, then the process ends by it
        try:
            yield tmp
            if not os.path.lexists(tmp):
                raise FileNotFoundError(f"the writer left nothing at {str(tmp)!r} for {str(target)!r}")
            if tmp.is_dir() != (kind == "dir"):
                raise ValueError(f"the writer made a {'folder' if tmp.is_dir() else 'file'} for {str(target)!r}, "
                                 f"expected a {'folder' if kind == 'dir' else 'file'}")
            fsync_tree(tmp)
            raise_swallowed()  # a stop a library swallowed while tmp was written: target untouched still
            with deferred():
                _place(tmp, target, overwrite=overwrite, overwrite_hint=overwrite_hint)
        except BaseException as exc:
            with deferred():
                _remove(tmp)
            if isinstance(exc, OSError) and exc.filename is None:
                raise named_os_error(exc, target) from exc
            raise
    _fsync_path(target.parent, directory=True)


#: The name ending of a plot (:func:`png_figure` writes a PNG whatever its name; ``packkit waste --plot`` checks it).
PLOT_SUFFIX = ".png"


def check_plot(target, option: str, *, inputs=(), overwrite: bool = False) -> Path:
    """:func:`check_output` of a plot (:func:`png_figure`), whose name must end in :data:`PLOT_SUFFIX`: else the usage
    error naming ``option`` (its argument name, :func:`packkit.errors.arg`)."""
    if not str(target).lower().endswith(PLOT_SUFFIX):
        raise ArgumentError("{plot} writes a PNG: give a file name ending in .png, got {got!r}", plot=arg(option),
                            got=str(target))
    return check_output(target, inputs=inputs, overwrite=overwrite)


@contextlib.contextmanager
def png_figure(path, *, overwrite: bool = False, **subplots):
    """``(fig, axes)`` of ``matplotlib.pyplot.subplots(**subplots)`` (the Agg backend: no display needed), saved
    as a PNG at ``path`` when the block ends, through :func:`atomic_output` (``path`` checked before anything is
    drawn; an existing one replaced only with ``overwrite=True``); the figure is closed either way::

        with png_figure("fill.png", figsize=(9, 4.8)) as (fig, ax):
            ax.bar(x, y)
    """
    check_output(path, overwrite=overwrite)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(**subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        with atomic_output(path, overwrite=overwrite) as tmp:
            fig.savefig(tmp, dpi=130, format="png")
    finally:
        plt.close(fig)
