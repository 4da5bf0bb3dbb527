"""The ids of a device-time-bounded subset of the ``gate`` suite (kernel-profile cases, bf16), for
``dsv4-parity run --suite gate --case-id ...`` on a GPU runner.

Every gate case with at most ``--max-tokens`` buffer rows, plus the ``--r128`` smallest ratio-128 cases (a
ratio-128 segment needs 128 tokens to have a compressed key, so they are never small). On the H200 a small case
costs a few seconds (kernel JIT dominates) while the largest gate cases take about a minute each in the float64
reference; the subset keeps BSHD and THD, r ∈ {0, 4, 128}, dense and sparse loss, packing features.

    python -m fused.gpu_suite [--max-tokens 384] [--r128 3]      # prints one case id per line
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Optional

from cases.case import Case
from cases.suites import load_suite


def select(max_tokens: int = 384, r128: int = 3, suite: str = "gate") -> list[Case]:
    cases = list(load_suite(suite))
    small = [c for c in cases if c.layout.num_tokens <= max_tokens]
    big_r128 = sorted((c for c in cases if c.config.compress_ratio == 128 and c.layout.num_tokens > max_tokens),
                      key=lambda c: c.layout.num_tokens)[:r128]
    return small + big_r128


def describe(cases: list[Case]) -> str:
    cells = collections.Counter((c.layout.kind, c.config.compress_ratio, c.loss_mode if c.computes_loss else "none")
                                for c in cases)
    return f"{len(cases)} cases: " + ", ".join(f"{k}/r{r}/{loss}={n}" for (k, r, loss), n in sorted(cells.items()))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fused.gpu_suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--r128", type=int, default=3)
    parser.add_argument("--suite", default="gate")
    args = parser.parse_args(argv)
    cases = select(args.max_tokens, args.r128, args.suite)
    print(describe(cases), file=sys.stderr)
    for c in cases:
        print(c.id)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
