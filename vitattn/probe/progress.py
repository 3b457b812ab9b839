"""Progress over batches on stderr: a tqdm bar on a terminal, a few plain lines otherwise.

When stderr is not a terminal (a log file, CI, a pipe) a tqdm bar would write a carriage-return frame
per refresh; instead one plain line ``probe: <desc> <done>/<total>`` is printed at most every 30 s,
and one at the end.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType

__all__ = ["Progress"]


class Progress:
    """``with Progress(total, desc, enabled) as bar: bar.update(n)``."""

    def __init__(self, total: int, desc: str, enabled: bool = True, interval: float = 30.0) -> None:
        self.total, self.desc, self.enabled, self.interval = total, desc, enabled, interval
        self.done = 0
        self._bar = None
        self._last = time.monotonic()
        if enabled and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm
            except ImportError:  # tqdm is optional: plain lines
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, unit="batch", leave=False, file=sys.stderr)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and time.monotonic() - self._last >= self.interval:
            self._line()

    def _line(self) -> None:
        self._last = time.monotonic()
        print(f"probe: {self.desc} {self.done}/{self.total} batches", file=sys.stderr, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and exc_type is None:
            self._line()
