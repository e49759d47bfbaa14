"""Progress a person can see, for the long-running things a person starts: the demos, `arrowbuf checkpoint
verify|export`, `arrowbuf inspect`/`ui` of a checkpoint or a journal, `arrowbuf bench`, the benchmark scripts.

Two pieces:

- `ProgressSink`: how long library work reports progress, `sink(phase, done, total, unit)`, called as it advances
  (restore of a checkpoint and of a journal, export, verify: `ExperienceStore.restore(path, progress=sink)`). Library
  code never prints; a caller that wants a display passes one.
- `ProgressMeter`: the display. On a terminal, a tqdm bar (rate, time left; `pip install tqdm`, in `arrowbuf[demo]`
  and `[bench]`); elsewhere (a pipe, a log file, CI), or on a terminal without tqdm, one plain line every `interval`
  seconds (default 2) with the same facts: done of total, percent, rate, elapsed, time left (work done within the
  first interval prints no line at all). A thread keeps it alive while the work is silent (processes starting, a
  long write): the elapsed time moves on a terminal and a line still comes every `interval` seconds elsewhere, so
  nothing looks hung. `PhasedProgress` is a `ProgressSink` that shows each phase as a meter of its own.

tqdm is imported when a meter starts on a terminal, never at import: `import arrowbuf` stays pyarrow and numpy.

Usage::

    with ProgressMeter(total=3000, desc="dqn", unit="step") as bar:
        while ...:
            bar.update_to(steps, episodes=12, ret="31.2")     # absolute; or bar.update(n) to advance
    store = ExperienceStore.restore("ckpt/", progress=PhasedProgress())
"""

from __future__ import annotations

import sys
import threading
import time
from typing import IO, Any, Protocol

from .. import config


class ProgressSink(Protocol):
    """Receives progress of long work: `sink(phase, done, total, unit)`, with `done` rising from 0 to `total` (None:
    unknown) in `unit`s ("B" for bytes, "record", "row", ...), once at the start of a phase and as it advances.

    Usage loop (what restore does)::

        for i, f in enumerate(files):
            read(f)
            sink("restore: row files", done_bytes, total_bytes, "B")
    """

    def __call__(self, phase: str, done: int, total: int | None, unit: str = "") -> None: ...


def _duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _bytes(n: float) -> str:
    for u in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or u == "TiB":
            return f"{n:.0f} {u}" if u == "B" else f"{n:.1f} {u}"
        n /= 1024
    return f"{n:.1f} TiB"


def _units(unit: str) -> str:
    return unit if not unit or unit == "B" or unit.endswith("s") else unit + "s"


class ProgressMeter:
    """A progress display (see the module docstring): a tqdm bar on a terminal, a line every `interval` seconds
    otherwise. A context manager; `close()` is idempotent and ends the bar, or prints a last line when lines were
    printed before.

    Args:
        total: the amount of work (None: unknown, then no percentage or time left).
        desc: what runs ("dqn", "verify ckpt/").
        unit: the unit of `total` ("step", "B" for bytes, shown scaled).
        file: where to write (default: sys.stderr, so that a command's output on stdout stays clean).
        enabled: False shows nothing (`--no-progress`).
        interval: seconds between two plain lines, and between two refreshes while nothing happens (default:
            `ARROWBUF_PROGRESS_INTERVAL`, 2 s; 0: a line at every update).
        bar: True/False forces the bar/the lines; None (default): a bar when `file` is a terminal and tqdm is there.
    """

    def __init__(self, total: float | None, desc: str = "", unit: str = "it", *, file: IO[str] | None = None,
                 enabled: bool = True, interval: float | None = None, bar: bool | None = None) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.file = file if file is not None else sys.stderr
        self.enabled = enabled
        self.interval = float(config.get("ARROWBUF_PROGRESS_INTERVAL") if interval is None else interval)
        self.n: float = 0
        self.postfix = ""
        self.start = time.monotonic()
        self._last_line = self.start
        self._lines = 0  # plain lines printed
        self._first: tuple[float, float] | None = None  # (time, amount) of the first advance
        self._lock = threading.Lock()
        self._closed = False
        self._bar: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not enabled:
            return
        if bar is None:
            bar = bool(getattr(self.file, "isatty", lambda: False)())
        if bar:
            try:
                from tqdm import tqdm
            except ImportError:  # lines instead: still progress, with rate and time left
                pass
            else:
                self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.file, dynamic_ncols=True,
                                 mininterval=0.5, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000)
        self._thread = threading.Thread(target=self._tick, name="arrowbuf-progress", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ what the work calls
    def update(self, n: float = 1, **info: Any) -> None:
        """Advance by `n`; `info` replaces the text after the numbers (`key=value, ...`)."""
        self.update_to(self.n + n, **info)

    def update_to(self, done: float, **info: Any) -> None:
        """Set the amount done to `done`; `info` replaces the text after the numbers (`key=value, ...`)."""
        if not self.enabled or self._closed:
            return
        with self._lock:
            first = self._first is None and done > self.n
            self.n = done if self.total is None else min(done, self.total)
            if first:
                self._first = (time.monotonic(), self.n)
            if info:
                self.postfix = ", ".join(f"{k}={v}" for k, v in info.items())
            if self._bar is not None:
                self._bar.n = self.n
                self._bar.set_postfix_str(self.postfix, refresh=False)
                self._bar.update(0)  # redraws at most every mininterval
                return
            if time.monotonic() - self._last_line >= self.interval:
                self._line()

    def note(self, text: str) -> None:
        """Replace the text after the numbers ("starting 4 workers", "writing parquet")."""
        if not self.enabled or self._closed:
            return
        with self._lock:
            self.postfix = text
            if self._bar is not None:
                self._bar.set_postfix_str(text, refresh=True)

    def close(self) -> None:
        """Stop the display, with a last line (or the bar's final state)."""
        if not self.enabled or self._closed:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            self._closed = True
            if self._bar is not None:
                self._bar.close()
            elif self._lines:  # work that ended within the first interval printed nothing, and says nothing now
                self._line(final=True)

    def __enter__(self) -> ProgressMeter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the display
    def line(self, final: bool = False) -> str:
        """The plain line: `desc: done/total unit (pct%), rate unit/s, elapsed, time left | postfix`."""
        now = time.monotonic()
        elapsed = now - self.start
        # the rate since the work first moved (once it moved again): start-up (imports, processes starting) is no
        # part of it
        t0, n0 = self._first if self._first is not None and self.n > self._first[1] else (self.start, 0.0)
        rate = (self.n - n0) / (now - t0) if now > t0 else 0.0
        parts = []
        b = self.unit == "B"
        units = _units(self.unit)
        done = _bytes(self.n) if b else f"{self.n:,.0f}"
        if self.total:
            total = _bytes(self.total) if b else f"{self.total:,.0f} {units}"
            parts.append(f"{done}/{total} ({100 * self.n / self.total:.0f}%)")
        else:
            parts.append(done if b else f"{done} {units}")
        if self.n and b:
            parts.append(f"{_bytes(rate)}/s")
        elif self.n:  # slow work (a benchmark, a run of minutes) reads better as seconds per unit
            parts.append(f"{rate:,.1f} {units}/s" if rate >= 1 else f"{1 / rate:,.1f} s/{self.unit}")
        parts.append(f"{_duration(elapsed)} elapsed")
        if self.total and self.n and not final and self.n < self.total:
            parts.append(f"~{_duration((self.total - self.n) / rate)} left")
        text = (f"{self.desc}: " if self.desc else "") + ", ".join(parts)
        return text + (f" | {self.postfix}" if self.postfix else "")

    def _line(self, final: bool = False) -> None:
        self._last_line = time.monotonic()
        self._lines += 1
        try:
            print(self.line(final), file=self.file, flush=True)
        except (OSError, ValueError):  # a closed pipe or file: progress is not worth an error
            self.enabled = False

    def _tick(self) -> None:
        """Keep the display alive while the work is silent: a line (or a refreshed bar) every `interval` s."""
        beat = max(0.25, self.interval)  # interval 0 (a line per update) does not make the silence a flood
        while not self._stop.wait(min(0.5, beat)):
            with self._lock:
                if self._closed:
                    return
                if self._bar is not None:
                    self._bar.refresh()
                elif time.monotonic() - self._last_line >= beat:
                    self._line()


class PhasedProgress:
    """A `ProgressSink` that shows each phase of long work as a `ProgressMeter` of its own (closing the previous
    one); `close()` closes the last. Keyword arguments go to every meter (`file`, `interval`, `bar`, `enabled`)."""

    def __init__(self, prefix: str = "", **meter: Any) -> None:
        self.prefix = prefix
        self.meter_args = meter
        self.current: ProgressMeter | None = None
        self.phase: str | None = None

    def __call__(self, phase: str, done: int, total: int | None, unit: str = "") -> None:
        if phase != self.phase or self.current is None:
            self.close()
            self.phase = phase
            self.current = ProgressMeter(total, f"{self.prefix}{phase}", unit or "it", **self.meter_args)
        self.current.update_to(done)

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None
            self.phase = None

    def __enter__(self) -> PhasedProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["PhasedProgress", "ProgressMeter", "ProgressSink"]
