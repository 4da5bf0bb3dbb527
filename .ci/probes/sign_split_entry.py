"""Which entry point observes sign-split's heads on this machine, and what each costs (issue 33).

For each case given (default: the gate's layer and core bf16 training cases with an indexer loss and the most rows),
runs :func:`parity.judge.sign_split.observe` twice on the implementation's provider: as the engine does (through the
public ``indexer`` where it agrees bit for bit with the case's forward) and with ``indexer`` hidden (one forward of
the case's entry point a head), and prints the probe, both times and whether the two patterns are equal.

    python3 .ci/probes/sign_split_entry.py [CASE_ID ...] [--impl fused] [--provider cudnn] [--count 4]

Prints; changes nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


class _Hidden:
    """``api`` without its ``indexer``."""

    indexer = None

    def __init__(self, api):
        self._api = api

    def __getattr__(self, name):
        return getattr(self._api, name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case_ids", nargs="*")
    ap.add_argument("--suite", default="gate")
    ap.add_argument("--impl", default="fused")
    ap.add_argument("--provider", default="auto")
    ap.add_argument("--count", type=int, default=4, help="cases per scope when none are named")
    args = ap.parse_args(argv)
    from cases.suites import find_case, load_suite
    from cases.tensors import materialize
    from parity import engine, impls
    from parity.judge import sign_split

    engine.configure_torch()
    impl = impls.load(args.impl)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    if args.case_ids:
        cases = [find_case(args.suite, cid) for cid in args.case_ids]
    else:
        pool = [c for c in load_suite(args.suite) if sign_split.applies(c) and c.dtype == "bfloat16"]
        largest = sorted(pool, key=lambda c: c.layout.num_tokens, reverse=True)
        cases = [c for scope in ("layer", "core") for c in [c for c in largest if c.scope == scope][:args.count]]
    print(f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, impl {args.impl}, provider {args.provider}")
    context = impl.context(args.provider)
    for case in cases:
        tensors = materialize(case, device)
        sign_split.observe(impl.api, case, tensors, context)  # warm-up (kernels, handles)
        timed = []
        for api in (impl.api, _Hidden(impl.api)):
            sync()
            t0 = time.perf_counter()
            got = sign_split.observe(api, case, tensors, context)
            sync()
            timed.append((time.perf_counter() - t0, got))
        (fast, a), (plain, b) = timed
        layout = "thd " if case.is_thd else "bshd"
        if a is None and b is None:  # production runs no indexer where no sequence has a compressed row
            print(f"{case.id} {case.scope:5s} {layout} rows {case.layout.num_tokens:5d}: no pattern either way "
                  "(no index scores observed)", flush=True)
            continue
        same = a is not None and b is not None and torch.equal(a[0], b[0])
        print(f"{case.id} {case.scope:5s} {layout} rows {case.layout.num_tokens:5d}: probe "
              f"{a[1] if a else None}, {fast:.3f} s against {plain:.3f} s through {b[1] if b else None} "
              f"({fast / plain:.2f}); patterns equal: {same}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
