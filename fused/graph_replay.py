"""CUDA-graph replay of the fused forward + backward under re-packing (GPU only).

Production captures the layer once per static shape: a THD buffer of ``T`` rows, ``cu_seqlens*`` of a fixed number
of entries, a fixed compressed capacity and a host ``max_seqlen``. Each step then **overwrites the cu_seqlens
tensors in place** with the step's packing and replays. Any boundary the composition read on the host at capture
time (a ``.item()``, a Python branch on a tensor, a size taken from a device value) is baked into the graph and is
wrong for every other packing — a known bug class.

:func:`check` captures ``attention_layer`` (or ``core_attention``) forward and backward for the first packing,
then for each further packing overwrites ``cu_seqlens_q`` / ``cu_seqlens_q_padded`` (and the packing-dependent dO)
in place, replays, and compares every output and gradient with an eager run of the same provider on that packing.
Negative control: the replayed result must differ from the eager result of the capture packing (a replay that
ignored the new boundaries would match that one instead).

    python -m fused.graph_replay --out DIR [--provider auto|torch] [--ratio 4] [--scope layer|core]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

from cases.case import Case
from cases.layout import ThdLayout
from cases.profiles import KERNEL_CONFIG
from cases.tensors import materialize

from . import attention_layer, core_attention, use_backend

Tensor = torch.Tensor
INPUT_ORDER = ("hidden", "query", "kv", "q_latent")

#: (real lengths, padded lengths) per packing: same segment count (zero-length segments keep it), same buffer,
#: different boundaries, different real-token totals, with and without slack rows.
PACKINGS = (
    ((700, 300, 500, 400), (704, 320, 512, 448)),
    ((1500, 100, 0, 300), (1536, 128, 0, 320)),
    ((2040, 0, 0, 0), (2048, 0, 0, 0)),
    ((128, 250, 512, 1000), (128, 256, 512, 1024)),
)
TOTAL = 2048


def layout(real: tuple, padded: tuple, ratio: int) -> ThdLayout:
    cu, cup = [0], [0]
    for r, p in zip(real, padded):
        cu.append(cu[-1] + r)
        cup.append(cup[-1] + p)
    capacity = TOTAL // ratio if ratio > 1 else None
    return ThdLayout(cu_seqlens=tuple(cu), cu_seqlens_padded=tuple(cup), total_tokens=TOTAL,
                     compressed_capacity=capacity).validate()


def make_case(ratio: int, scope: str, sparse: bool, seed: int = 7) -> Case:
    config = KERNEL_CONFIG.replace(compress_ratio=ratio, dsa_indexer_use_sparse_loss=sparse)
    real, padded = PACKINGS[0]
    return Case(config=config, layout=layout(real, padded, ratio), dtype="bfloat16", training=True, scope=scope,
                seed=seed, device="cuda", profile="kernel").validate()


class Step:
    """Static buffers and one fused forward + backward on them (what the graph captures)."""

    def __init__(self, case: Case, device: torch.device):
        t = materialize(case, device)
        self.case = case
        self.inputs = {n: v.detach().clone().requires_grad_(True) for n, v in t.inputs.items()}
        self.params = {n: v.detach().clone().requires_grad_(True) for n, v in t.params.items()}
        # the static envelope: max_seqlen bounds every packing's segments (the buffer length), fixed at capture
        self.psp = dataclasses.replace(t.packed_seq_params, max_seqlen_q=TOTAL)
        self.d_out = t.grad_output.clone()
        self.leaves = [self.inputs[n] for n in INPUT_ORDER if n in self.inputs] + list(self.params.values())
        self.names = [n for n in INPUT_ORDER if n in self.inputs] + list(self.params)

    def set_packing(self, lay: ThdLayout, d_out: Tensor) -> None:
        """Overwrite the cu_seqlens tensors and dO **in place** (the graph keeps their addresses)."""
        fresh = lay.packed_seq_params(self.case.config.compress_ratio, device=self.d_out.device)
        self.psp.cu_seqlens_q.copy_(fresh.cu_seqlens_q)
        self.psp.cu_seqlens_q_padded.copy_(fresh.cu_seqlens_q_padded)
        self.d_out.copy_(d_out)

    def run(self) -> dict[str, Tensor]:
        kwargs = dict(training=self.case.training)
        if self.case.scope == "layer":
            res = attention_layer(self.inputs["hidden"], self.params, self.case.config, self.psp, **kwargs)
        else:
            i = self.inputs
            res = core_attention(i["query"], i["kv"], i["hidden"], i["q_latent"], self.params, self.case.config,
                                 self.psp, **kwargs)
        grads = torch.autograd.grad(res.objective(self.d_out), self.leaves, allow_unused=True)
        out = {"out": res.out.detach(), "lse": res.lse.detach()}
        if res.indexer_loss is not None:
            out["indexer_loss"] = res.indexer_loss.detach().reshape(1)
        if res.topk_indices is not None:
            out["topk_indices"] = res.topk_indices.detach()
        for name, g in zip(self.names, grads):
            if g is not None:
                out[f"grad/{name}"] = g.detach()
        return out


def d_out_for(case: Case, lay: ThdLayout, device) -> Tensor:
    """The packing's dO: the case's seeded dO, zero on non-real rows at layer scope (as ``materialize`` does)."""
    t = materialize(dataclasses.replace(case, layout=lay), device)
    return t.grad_output


def compare(graph: dict, eager: dict, real: Tensor) -> dict:
    """Per tensor: exact match or relative L2 over real rows (row tensors) / everything (parameter gradients)."""
    rows = {}
    for name, e in eager.items():
        g = graph.get(name)
        if g is None:
            rows[name] = {"match": False, "why": "missing in the replay"}
            continue
        if name in ("out", "lse", "topk_indices") or name.startswith("grad/") and g.shape[:1] == real.shape:
            g, e = g[real], e[real]
        g64, e64 = torch.nan_to_num(g.double(), posinf=0, neginf=0), torch.nan_to_num(e.double(), posinf=0, neginf=0)
        exact = bool(torch.equal(g, e))
        denom = float(e64.norm())
        rel = float((g64 - e64).norm()) / denom if denom > 0 else float((g64 - e64).norm())
        tol = 0.0 if name == "topk_indices" else 2e-2  # backward atomics reorder fp32 sums; bf16 rounding follows
        rows[name] = {"exact": exact, "rel_l2": rel, "match": exact or rel <= tol}
    return rows


def capture(fn, warmups: int = 1) -> tuple:
    """``(graph, static result)`` of ``fn()`` captured in a CUDA graph, after ``warmups`` calls on a side stream
    (JIT compiles and plan caches happen there, as capture requires); replaying the graph refills the result."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def check(ratio: int = 4, scope: str = "layer", sparse: bool = True, provider: str = "auto",
          require: tuple = ()) -> dict:
    """Capture on ``PACKINGS[0]``, replay on the others; returns a JSON-able report."""
    device = torch.device("cuda")
    case = make_case(ratio, scope, sparse)
    report: dict = {"ratio": ratio, "scope": scope, "loss": "sparse" if sparse else "dense", "provider": provider,
                    "total_tokens": TOTAL, "packings": [], "capture": None}
    layouts = [layout(r, p, ratio) for r, p in PACKINGS]
    d_outs = [d_out_for(case, lay, device) for lay in layouts]
    reals = [lay.real_row_mask(device) for lay in layouts]

    with use_backend(provider, require=require) as plan:
        step = Step(case, device)
        eager = []
        for lay, d_out in zip(layouts, d_outs):  # eager references (fresh buffers each time: no aliasing)
            ref = Step(case, device)
            ref.set_packing(lay, d_out)
            eager.append(ref.run())
        report["plan"] = dict(plan.record)
        try:
            t0 = time.perf_counter()
            graph, static_out = capture(step.run, warmups=2)
            report["capture"] = {"ok": True, "seconds": round(time.perf_counter() - t0, 3)}
        except Exception as exc:  # noqa: BLE001 - a capture failure is the finding: where it happened
            report["capture"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
                                 "traceback": traceback.format_exc(limit=12)[-4000:]}
            return report

    for i, (lay, d_out, real) in enumerate(zip(layouts, d_outs, reals)):
        step.set_packing(lay, d_out)
        graph.replay()
        torch.cuda.synchronize()
        replayed = {k: v.clone() for k, v in static_out.items()}
        per_tensor = compare(replayed, eager[i], real)
        entry = {"packing": i, "cu_seqlens": list(lay.cu_seqlens), "cu_seqlens_padded": list(lay.cu_seqlens_padded),
                 "matches_eager": all(r["match"] for r in per_tensor.values()), "tensors": per_tensor}
        if i > 0:  # negative control: the capture packing's eager result must NOT match this replay
            control = compare(replayed, eager[0], real & reals[0])
            entry["differs_from_capture_packing"] = not all(r["match"] for r in control.values())
        report["packings"].append(entry)
    replays = report["packings"][1:]
    report["passed"] = bool(report["capture"]["ok"]) and len(replays) >= 3 and all(
        p["matches_eager"] and p["differs_from_capture_packing"] for p in replays) and \
        report["packings"][0]["matches_eager"]
    return report


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fused.graph_replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--provider", default="auto")
    parser.add_argument("--require", nargs="*", default=[])
    parser.add_argument("--ratio", type=int, nargs="*", default=[4])
    parser.add_argument("--scope", default="layer", choices=("layer", "core"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    reports = []
    for ratio in args.ratio:
        rep = check(ratio=ratio, scope=args.scope, provider=args.provider, require=tuple(args.require))
        reports.append(rep)
        print(json.dumps({k: v for k, v in rep.items() if k != "packings"}, default=str))
        for p in rep["packings"]:
            worst = max((t.get("rel_l2", 0.0) for t in p["tensors"].values()), default=0.0)
            print(f"  packing {p['packing']} {p['cu_seqlens_padded']}: matches eager {p['matches_eager']} "
                  f"(worst rel_l2 {worst:.2e}), differs from capture packing {p.get('differs_from_capture_packing')}")
    (args.out / "graph_replay.json").write_text(json.dumps(reports, indent=2, default=str) + "\n")
    return 0 if all(r.get("passed") for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())
