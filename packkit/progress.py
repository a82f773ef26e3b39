"""Progress bars: tqdm on stderr when asked for and installed, else a silent stand-in."""

from __future__ import annotations

__all__ = ["progress_bar"]


class _NoBar:
    def update(self, n=1):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def progress_bar(*, total: int, unit: str, enabled: bool, desc: str | None = None):
    """A tqdm bar on stderr when ``enabled`` (and tqdm is installed), else a silent stand-in."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm  # lazy: tqdm is optional
    except ImportError:  # pragma: no cover - tqdm comes with the datasets extra
        return _NoBar()
    return tqdm(total=total, unit=unit, unit_scale=unit == "tok", desc=desc, leave=False, dynamic_ncols=True)
