"""Does the ``gather-backward-atomic`` stand-in make production's KV-gather backward scatter atomic on a case (the
scatter run with deterministic algorithms off)? (Issue 28: on the H200, 2026-12-04, gate case ``e0e0647850c7`` raised
``cub sort does not support sorting more than INT_MAX elements`` in ``GatherBackward0`` at ``csa.py:687`` with the
stand-in installed; on a CPU, dims shrunk, the hook matches that gather and its scatter runs non-deterministic.)

Runs the case once through production's unfused path (``--impl megatron --provider unfused``) with every scatter /
index_put dispatched outside the stand-in's mode printed with the deterministic-algorithms flag at that moment
(``False`` on the KV-gather scatter: the stand-in acted) and whether it has the KV-gather signature, then how many
scatters the stand-in made atomic. (2026-12-06, H200, the graph-hook version: ``install: 0 hooked``, no
``GatherBackward0`` in the output's graph, the scatter ran deterministic and raised.)

    python3 .ci/probes/gather_backward.py e0e0647850c7 [--shrink] [--device cuda]

``--shrink``: the case's widths cut to a CPU size (its rows, layout, top-k and mode kept). Megatron: ``DSV4_MEGATRON``
or ``DSV4_MEGATRON_SNAPSHOT`` as for ``dsv4-parity run``. Prints; changes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case_id")
    ap.add_argument("--suite", default="gate")
    ap.add_argument("--shrink", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    from adapters.megatron import gather_backward
    from cases import suites
    from cases.tensors import materialize
    from parity import engine, impls
    from parity.judge.snapshot import take_snapshot

    engine.configure_torch()
    case = suites.find_case(args.suite, args.case_id)
    if args.shrink:
        small = dataclasses.replace(case.config, hidden_size=32, num_attention_heads=2, v_head_dim=16,
                                    qk_pos_emb_head_dim=8, q_lora_rank=16, o_groups=1, o_lora_rank=8,
                                    dsa_indexer_n_heads=2, dsa_indexer_head_dim=8)
        case = dataclasses.replace(case, config=small, device="any", profile="tiny")
    print(f"case {args.case_id}: {case.layout}, training={case.training}, scope={case.scope}, dtype={case.dtype}, "
          f"device {args.device}")

    original = gather_backward.atomic_kv_scatter
    modes = []

    @contextlib.contextmanager
    def atomic_kv_scatter(**kwargs):
        with original(**kwargs) as mode:
            modes.append(mode)
            print(f"  stand-in mode: {'on' if mode is not None else 'off'} (deterministic algorithms "
                  f"{torch.are_deterministic_algorithms_enabled()}, stand-in enabled {gather_backward.enabled()})")
            yield mode

    gather_backward.atomic_kv_scatter = atomic_kv_scatter

    class Scatters(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if "scatter" in name or "index_put" in name:
                shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
                print(f"  {name}: deterministic {torch.are_deterministic_algorithms_enabled()} {shapes}, KV-gather "
                      f"signature {gather_backward.is_kv_scatter(tuple(args), cuda_only=False)}")
            return func(*args, **(kwargs or {}))

    megatron = impls.load("megatron")
    tensors = materialize(case, args.device)
    try:
        with Scatters():
            take_snapshot(megatron.api, case, tensors, context=megatron.context("unfused"))
    except Exception as exc:  # noqa: BLE001 — the probe reports what production raised
        print(f"raised: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        return 1
    finally:
        print(f"  made atomic: {[m.made_atomic for m in modes if m is not None]}")
    print("ran to the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
