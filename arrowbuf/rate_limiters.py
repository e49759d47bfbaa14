"""Rate limiters: when a sample or an insert may proceed (Reverb's semantics).

A store asks its limiter before each sample and insert and waits (up to the call's `timeout`) while it says no.
Usage::

    limiter = SampleToInsertRatio(samples_per_insert=4.0, min_size=1000, error_buffer=100.0)
    store = ExperienceStore(schema, capacity, rate_limiter=limiter)
    store.sample(256, timeout=5.0)      # blocks while sampling would run too far ahead of inserts

Counts are of items: a sample of n rows counts n samples, an extend of n rows n inserts.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

from .errors import InvalidArgument


@dataclass
class Counters:
    """What a limiter decides on: items inserted and sampled so far, and the current size."""

    inserts: int = 0
    samples: int = 0
    size: int = 0


class RateLimiter(abc.ABC):
    """Decides whether `n` samples or inserts may proceed now."""

    #: The name specs record this class under (`arrowbuf.samplers.spec`); empty: cannot be recorded.
    spec_name: ClassVar[str] = ""

    @abc.abstractmethod
    def can_sample(self, n: int, c: Counters) -> bool:
        """True when sampling `n` items now keeps the limiter's bound."""

    def can_insert(self, n: int, c: Counters) -> bool:
        """True when inserting `n` items now keeps the limiter's bound."""
        return True

    def blocked_reason(self, c: Counters) -> str:
        return f"{self!r} blocks (size={c.size}, inserts={c.inserts}, samples={c.samples})"


class MinSize(RateLimiter):
    """Sampling waits until the store holds at least `min_size` sampleable items; inserts never wait."""

    spec_name = "min_size"

    def __init__(self, min_size: int = 1) -> None:
        if min_size < 1:
            raise InvalidArgument(f"min_size must be >= 1, got {min_size}")
        self.min_size = int(min_size)

    def can_sample(self, n: int, c: Counters) -> bool:
        return c.size >= self.min_size

    def __repr__(self) -> str:
        return f"MinSize({self.min_size})"


class SampleToInsertRatio(RateLimiter):
    """Keep samples/inserts near `samples_per_insert` once `min_size` items are stored.

    As in Reverb: with `diff = inserts * samples_per_insert - samples`, a sample of n is allowed while
    `diff - n >= min_diff` and an insert of n while `diff + n * samples_per_insert <= max_diff`, where
    `[min_diff, max_diff] = min_size * samples_per_insert +- error_buffer`. Below `min_size` sampling waits and inserts
    proceed.
    """

    spec_name = "sample_to_insert_ratio"

    def __init__(self, samples_per_insert: float, min_size: int = 1, error_buffer: float | None = None) -> None:
        if samples_per_insert <= 0:
            raise InvalidArgument(f"samples_per_insert must be > 0, got {samples_per_insert}")
        if min_size < 1:
            raise InvalidArgument(f"min_size must be >= 1, got {min_size}")
        self.samples_per_insert = float(samples_per_insert)
        self.min_size = int(min_size)
        if error_buffer is None:
            error_buffer = max(1.0, self.samples_per_insert) * max(1, self.min_size)
        if error_buffer < max(1.0, self.samples_per_insert):
            raise InvalidArgument(
                f"error_buffer must be >= max(1, samples_per_insert) = {max(1.0, self.samples_per_insert)}, "
                f"got {error_buffer}: a smaller buffer can deadlock"
            )
        self.error_buffer = float(error_buffer)
        offset = self.samples_per_insert * self.min_size
        self.min_diff = offset - self.error_buffer
        self.max_diff = offset + self.error_buffer

    def _diff(self, c: Counters) -> float:
        return c.inserts * self.samples_per_insert - c.samples

    def can_sample(self, n: int, c: Counters) -> bool:
        if c.size < self.min_size:
            return False
        return self._diff(c) - n >= self.min_diff

    def can_insert(self, n: int, c: Counters) -> bool:
        if c.inserts + n <= self.min_size or c.size < self.min_size:
            return True
        return self._diff(c) + n * self.samples_per_insert <= self.max_diff

    def __repr__(self) -> str:
        return (f"SampleToInsertRatio(samples_per_insert={self.samples_per_insert}, min_size={self.min_size}, "
                f"error_buffer={self.error_buffer})")


__all__ = ["RateLimiter", "Counters", "MinSize", "SampleToInsertRatio"]
