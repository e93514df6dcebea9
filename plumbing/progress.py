"""Progress: on a terminal (stderr is a TTY), a phase gets a tqdm bar with its rate and ETA. In a log file (CI, SLURM,
nohup, a pipe) bars would be redraws, so a phase writes a plain line instead, every PROGRESS_INTERVAL seconds (default
10; after a phase's first 10 minutes, every 6 intervals), and a last one when it ends. Log lines go through `write`,
which keeps them above the bars."""
from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm


def interactive() -> bool:
    return sys.stderr.isatty()

def width() -> dict:
    """The bar follows the terminal's width; a terminal that reports no size (a bare pty) gets 100 x 50."""
    try:
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except OSError:
        columns = 0
    return {"dynamic_ncols": True} if columns else {"ncols": 100, "nrows": 50}

def write(message: str) -> None:
    """print(message) to stdout, above any bar."""
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()

def duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"

class Progress:
    """Progress of one phase of `total` units: `update(n)` after each piece of work, `set_postfix(**values)` to
    show values beside it (None is left out). `report_each`: in a log, a line for every update (slow units).
    Costs a clock read per update: nothing waits for a GPU."""

    def __init__(self, total: int, desc: str, unit: str = "it", enabled: bool = True, leave: bool = False,
                 report_each: bool = False, initial: int = 0):
        self.total, self.desc, self.unit, self.n, self.postfix = total, desc, unit, initial, ""
        self.initial = initial  # done before (a resumed run): not in the rate
        self.enabled, self.report_each = enabled, report_each  # report_each: a plain line for every update
        self.interval = float(os.environ.get("PROGRESS_INTERVAL", 10))
        self.bar = tqdm(total=total, desc=desc, unit=unit, leave=leave, initial=initial, **width()) \
            if enabled and interactive() else None
        self.start = self.last = self.last_update = time.monotonic()
        self.lines = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.last_update = time.monotonic()
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled:
            if self.report_each or now - self.last >= self.interval * (1 if now - self.start < 600 else 6):
                self.last = now
                self.lines += 1
                write(self.line(now))

    def unpause(self) -> None:
        """The time since the last update (a dev gate, say) counts neither in the rate nor in the ETA."""
        gap = time.monotonic() - self.last_update
        self.start, self.last, self.last_update = self.start + gap, self.last + gap, self.last_update + gap
        if self.bar is not None:
            self.bar.unpause()

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                 for k, v in values.items() if v is not None)
        if self.bar is not None:
            self.bar.set_postfix_str(self.postfix, refresh=False)

    def line(self, now: float) -> str:
        elapsed = now - self.start
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.n) / rate if rate > 0 else None
        done = f"{self.n}/{self.total} {self.unit}s ({100 * self.n / max(self.total, 1):.0f}%)"
        postfix = f"  {self.postfix}" if self.postfix else ""
        return f"{self.desc}: {done}, {rate:.3g} {self.unit}s/s, {duration(elapsed)} elapsed, ETA " \
               f"{duration(eta)}{postfix}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled and self.lines and not self.report_each:  # a phase that reported once reports its end
            elapsed = time.monotonic() - self.start
            self.lines = 0
            write(f"{self.desc}: {self.n}/{self.total} {self.unit}s in {duration(elapsed)}")
