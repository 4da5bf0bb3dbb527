"""Does the ``gather-backward-atomic`` stand-in hook production's KV gather on a case, and does the gather's backward
then run with deterministic algorithms off? (Issue 28: on the H200, 2026-12-04, gate case ``e0e0647850c7`` raised
``cub sort does not support sorting more than INT_MAX elements`` in ``GatherBackward0`` at ``csa.py:687`` with the
stand-in installed; on a CPU, dims shrunk, the hook matches that gather and its scatter runs non-deterministic.)

Runs the case once through production's unfused path (``--impl megatron --provider unfused``) with every
``GatherBackward0`` in the output's graph listed (shapes, strides, whether the stand-in's shape test matches) and every
scatter / index_put the backward dispatches printed with the deterministic-algorithms flag at that moment.

    python3 .ci/probes/gather_backward.py e0e0647850c7 [--shrink] [--device cuda]

``--shrink``: the case's widths cut to a CPU size (its rows, layout, top-k and mode kept). Megatron: ``DSV4_MEGATRON``
or ``DSV4_MEGATRON_SNAPSHOT`` as for ``dsv4-parity run``. Prints; changes nothing.
"""

from __future__ import annotations

import argparse
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

    original = gather_backward.install

    def install(output, *, cuda_only: bool = True):
        for node in gather_backward._nodes(output.grad_fn):
            if node.name() == "GatherBackward0":
                src, idx = node._saved_self, node._saved_index
                print(f"  GatherBackward0: self {tuple(src.shape)} stride {src.stride()} {src.device}, index "
                      f"{tuple(idx.shape)} stride {idx.stride()}, dim {node._saved_dim}: stand-in shape test "
                      f"{gather_backward._is_kv_gather(node, cuda_only=False)}")
        hooked = original(output, cuda_only=cuda_only)
        print(f"  install: {hooked} hooked (deterministic algorithms {torch.are_deterministic_algorithms_enabled()}, "
              f"stand-in enabled {gather_backward.enabled()}, output on {output.device})")
        return hooked

    gather_backward.install = install

    class Scatters(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if "scatter" in name or "index_put" in name:
                shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
                print(f"  {name}: deterministic {torch.are_deterministic_algorithms_enabled()} {shapes}")
            return func(*args, **(kwargs or {}))

    megatron = impls.load("megatron")
    tensors = materialize(case, args.device)
    try:
        with Scatters():
            take_snapshot(megatron.api, case, tensors, context=megatron.context("unfused"))
    except Exception as exc:  # noqa: BLE001 — the probe reports what production raised
        print(f"raised: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        return 1
    print("ran to the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
