"""A progress bar for long work: redrawn in place on a terminal, a line per quarter in a log."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``update(done)`` as work finishes; ``unit`` names what is counted."""

    def __init__(self, total: int, unit: str = "requests", out: TextIO | None = None, width: int = 30) -> None:
        self.total, self.unit, self.width = total, unit, width
        self.out = out or sys.stderr
        self.t0 = time.monotonic()
        self.last = -1

    def update(self, done: int) -> None:
        elapsed = time.monotonic() - self.t0
        if not self.out.isatty():
            quarter = max(1, self.total // 4)
            if done != self.last and (done == self.total or (done and done % quarter == 0)):
                print(f"  {done}/{self.total} {self.unit}  {elapsed:6.1f}s", file=self.out, flush=True)
            self.last = done
            return
        filled = int(self.width * done / max(self.total, 1))
        print(f"\r  [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {self.unit}  {elapsed:6.1f}s",
              end="" if done < self.total else "\n", file=self.out, flush=True)
        self.last = done
