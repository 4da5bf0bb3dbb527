"""A tiny deterministic random source for the case generator (SplitMix64).

Self-contained on purpose: the stored suite files must regenerate bit-identically on every Python version and
platform, which ``random.Random``'s derived methods do not promise. Only integer arithmetic is used.
"""

from __future__ import annotations

import hashlib
from typing import Sequence, TypeVar

T = TypeVar("T")
_MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
"""SplitMix64's state increment."""
MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
"""The multipliers of SplitMix64's output function."""


def stream_state(seed: int, *labels: object) -> int:
    """The initial state of stream ``(seed, *labels)``: the first 8 bytes, little endian, of the sha256 of
    ``"{seed}/{label}/..."``."""
    digest = hashlib.sha256("/".join([str(seed)] + [str(x) for x in labels]).encode()).digest()
    return int.from_bytes(digest[:8], "little")


class Rng:
    """SplitMix64 stream. ``Rng(seed, "label")`` derives an independent stream per label."""

    def __init__(self, seed: int, *labels: object):
        self._state = stream_state(seed, *labels)

    def next64(self) -> int:
        self._state = (self._state + GOLDEN) & _MASK
        z = self._state
        z = ((z ^ (z >> 30)) * MIX[0]) & _MASK
        z = ((z ^ (z >> 27)) * MIX[1]) & _MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """Uniform integer in ``[0, n)`` (rejection sampling, no modulo bias)."""
        if n <= 0:
            raise ValueError(f"below() needs a positive bound, got {n}")
        limit = (1 << 64) - ((1 << 64) % n)
        while True:
            x = self.next64()
            if x < limit:
                return x % n

    def between(self, lo: int, hi: int) -> int:
        """Uniform integer in ``[lo, hi]`` (both ends included)."""
        if hi < lo:
            raise ValueError(f"empty range [{lo}, {hi}]")
        return lo + self.below(hi - lo + 1)

    def chance(self, percent: int) -> bool:
        """True with probability ``percent`` / 100."""
        return self.below(100) < percent

    def choice(self, items: Sequence[T]) -> T:
        return items[self.below(len(items))]

    def weighted(self, pairs: Sequence[tuple[T, int]]) -> T:
        """Pick a value from ``(value, integer weight)`` pairs."""
        total = sum(w for _, w in pairs)
        x = self.below(total)
        for value, w in pairs:
            if x < w:
                return value
            x -= w
        raise AssertionError("unreachable")

    def seed(self) -> int:
        """A fresh case seed (31 bits: readable in a repro line)."""
        return self.below(1 << 31)
