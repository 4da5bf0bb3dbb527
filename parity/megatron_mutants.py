"""Real-code mutants: planted bugs applied as text patches to a scratch copy of Megatron-LM (never the user's tree),
each run in a fresh process (Python imports ``megatron`` once) with ``--impl megatron`` on the cases that reach it.

A mutant is **killed** when, on every provider that executes its code, a case that passes on the clean tree fails or
errors with the patch applied (``known`` is not a kill: a registered deviation is not the planted bug).
``dsv4-parity mutants --impl megatron`` prints one line per mutant and ends with ``mutants: K/N killed``; it exits 0
iff every mutant was killed. A patch that no longer applies (upstream moved the line) is reported, never silently
skipped.

The catalogue (:data:`MUTANTS`): the seed's three review bugs in the fused THD code, and more across production's
PyTorch and fused paths. Each names the providers that execute its code and the smoke cases that reach it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from adapters.megatron.source import MegatronSourceError, locate
from cases.suites import load_suite
from parity.engine import RunOptions, configure_torch, run_case
from parity.impls import load

VARIANT = "megatron/core/transformer/experimental_attention_variant"
FUSED = f"{VARIANT}/csa_utils/fused_sparse_attention.py"
CSA = f"{VARIANT}/csa.py"
HYBRID = f"{VARIANT}/deepseek_v4_hybrid_attention.py"


@dataclass(frozen=True)
class Mutant:
    """One planted bug: replace ``old`` (which must occur exactly once, or pick occurrence ``nth``) by ``new`` in
    ``path``; killed by some case of ``cases`` on one of ``providers``."""

    name: str
    description: str
    path: str
    old: str
    new: str
    providers: tuple[str, ...]
    cases: tuple[str, ...]
    nth: Optional[int] = None


MUTANTS: tuple[Mutant, ...] = (
    # ---- the seed's three review bugs, in the fused THD code -----------------------------------------------------
    Mutant("thd_dense_bwd_no_max_seqlen", "fused THD dense-loss indexer backward called without max_seqlen_q/k",
           FUSED,
           "                        max_seqlen_q=int(max_seqlen_q),\n"
           "                        max_seqlen_k=int(max_seqlen_compressed_idx),\n",
           "", ("emulated",), ("4094c96fb157",)),
    Mutant("fake_bshd_view_over_batch", "fused sparse-loss indexer gradient: a .view over the leading (batch) "
           "dimension instead of the permute (right only for one sequence)",
           FUSED, 'precomputed_grad_q_indexer = ig["d_index_q"].permute(1, 0, 2, 3).contiguous()',
           'precomputed_grad_q_indexer = ig["d_index_q"].view(ig["d_index_q"].shape[1], '
           'ig["d_index_q"].shape[0], *ig["d_index_q"].shape[2:])',
           ("emulated",), ("9a8dbea368d1", "2eb1db7b4212"), nth=0),
    Mutant("invalid_comp_rows_by_count", "cat_per_segment routes invalid (capacity-padding) compressed rows by the "
           "true count instead of the capacity: onto valid kv_full rows",
           CSA, "dst_comp = torch.where(valid_comp, dst_comp, total_kv + src_comp)",
           "dst_comp = torch.where(valid_comp, dst_comp, total_kv + src_comp - cu_seqlens_compressed[-1])",
           ("unfused", "emulated"), ("6cd75c50f538", "03836235949d")),
    # ---- production's PyTorch path -----------------------------------------------------------------------------
    Mutant("sink_dropped_unfused", "unfused sparse attention: the sink left out of the softmax denominator",
           CSA, "attn_weights = exp_scores / (exp_scores.sum(dim=-1, keepdim=True) + exp_sink)",
           "attn_weights = exp_scores / exp_scores.sum(dim=-1, keepdim=True)",
           ("unfused",), ("8f5a75c53c73", "c63c8c6d34a6")),
    Mutant("indexer_causal_off_by_one_unfused", "unfused BSHD indexer: compressed causal mask one token late",
           CSA, "positions = torch.arange(1, sq + 1, device=x.device).unsqueeze(1)",
           "positions = torch.arange(2, sq + 2, device=x.device).unsqueeze(1)",
           ("unfused",), ("9a8dbea368d1", "45aaf0ad85c7")),
    # ---- shared by both paths ------------------------------------------------------------------------------------
    Mutant("window_excludes_self", "sliding window (BSHD) drops the query's own position",
           CSA, "matrix = torch.where(matrix > base, -1, matrix)",
           "matrix = torch.where(matrix >= base, -1, matrix)",
           ("unfused", "emulated"), ("8f5a75c53c73", "c63c8c6d34a6")),
    Mutant("output_inverse_rope_dropped", "layer output: the inverse RoPE applied forward (inverse=False)",
           HYBRID, "                mla_rotary_interleaved=True,\n                inverse=True,\n"
                   "                mla_output_remove_interleaving=True,\n"
                   "                max_seqlen=rope_max_seqlen_kv,",
           "                mla_rotary_interleaved=True,\n                inverse=False,\n"
           "                mla_output_remove_interleaving=True,\n                max_seqlen=rope_max_seqlen_kv,",
           ("unfused", "emulated"), ("c63c8c6d34a6", "8f5a75c53c73")),
    Mutant("compressor_real_offsets", "THD compressor: segment boundaries from the real instead of the padded "
           "cu_seqlens", CSA,
           "            cu_seqlens = (\n                packed_seq_params.cu_seqlens_q_padded\n",
           "            cu_seqlens = (\n                packed_seq_params.cu_seqlens_q\n",
           ("unfused", "emulated"), ("ab101a5d94c2", "f2ceea9c0311")),
    Mutant("fused_loss_coeff_ignored", "fused Path B: the indexer-loss coefficient read as 1",
           CSA, "indexer_loss_coeff = self.config.dsa_indexer_loss_coeff or 0.0",
           "indexer_loss_coeff = 1.0", ("emulated",),
           ("9a8dbea368d1", "45aaf0ad85c7"), nth=0),
)


class PatchError(RuntimeError):
    """A mutant whose patch no longer applies to this Megatron-LM revision."""


def apply(root: Path, mutant: Mutant) -> None:
    """Apply ``mutant`` to the tree at ``root`` (a scratch copy)."""
    path = root / mutant.path
    text = path.read_text(encoding="utf-8")
    count = text.count(mutant.old)
    if count == 0 or (mutant.nth is None and count != 1):
        raise PatchError(f"mutant {mutant.name}: the patched code occurs {count} times in {mutant.path} "
                         "(expected once): upstream changed; update parity/megatron_mutants.py")
    start = -1
    for _ in range((mutant.nth or 0) + 1):
        start = text.index(mutant.old, start + 1)
    path.write_text(text[:start] + mutant.new + text[start + len(mutant.old):], encoding="utf-8")


def scratch_copy(root: Path, into: Path) -> Path:
    """A copy of ``root``'s ``megatron/`` package (the user's tree is never written)."""
    target = into / "megatron-scratch"
    shutil.copytree(root / "megatron", target / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    return target


# ---- child process: run cases on one tree ---------------------------------------------------------------------
def _child(tree: str, jobs: list) -> list:
    """``[{case_id, provider, outcome, message}]`` for ``jobs`` = ``[(provider, case_id), ...]`` on ``tree``."""
    os.environ["DSV4_MEGATRON"] = tree
    configure_torch()
    cases = {c.id: c for c in load_suite("smoke")}
    impl, ref = load("megatron"), load("reference")
    out = []
    for provider, case_id in jobs:
        r = run_case(cases[case_id], impl, ref, RunOptions(impl="megatron", provider=provider, device="cpu"))
        out.append({"case_id": case_id, "provider": provider, "outcome": r.outcome, "message": r.message[:300]})
    return out


def run_child(tree: Path, jobs: list, timeout: float = 900.0) -> list:
    env = dict(os.environ, DSV4_MEGATRON=str(tree), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "parity.megatron_mutants", "--child", str(tree), json.dumps(jobs)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"mutant child process failed (exit {proc.returncode}): {tail[0]}")
    return json.loads(lines[-1])


# ---- the suite --------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    name: str
    status: str  # killed / survived / not applied / no clean case
    case_id: Optional[str] = None
    provider: Optional[str] = None
    message: str = ""
    seconds: float = 0.0


def jobs_of(mutant: Mutant) -> list:
    return [(p, c) for p in mutant.providers for c in mutant.cases]


def run_suite(source_root: Path, names: Optional[Sequence[str]] = None, echo=print) -> list[Outcome]:
    """The clean tree once, then every mutant (in its own scratch copy and process)."""
    chosen = [m for m in MUTANTS if not names or m.name in names]
    with tempfile.TemporaryDirectory(prefix="dsv4-megatron-mutants-") as tmp:
        clean_jobs = sorted({job for m in chosen for job in jobs_of(m)})
        clean = {(r["provider"], r["case_id"]): r for r in run_child(source_root, clean_jobs)}
        not_clean = [f"{p}/{c}: {r['outcome']}" for (p, c), r in clean.items() if r["outcome"] != "pass"]
        echo(f"clean: {len(clean) - len(not_clean)}/{len(clean)} (provider, case) runs pass"
             + (f"; not clean (cannot kill): {', '.join(not_clean)}" if not_clean else ""))
        outcomes = []
        for mutant in chosen:
            start = time.perf_counter()
            work = Path(tempfile.mkdtemp(prefix=f"{mutant.name}-", dir=tmp))
            tree = scratch_copy(source_root, work)
            try:
                apply(tree, mutant)
            except PatchError as exc:
                outcomes.append(Outcome(mutant.name, "not applied", message=str(exc)))
                echo(describe(outcomes[-1]))
                continue
            jobs = [job for job in jobs_of(mutant) if clean[job]["outcome"] == "pass"]
            if not jobs:
                outcomes.append(Outcome(mutant.name, "no clean case"))
            else:
                results = run_child(tree, jobs)
                kills = {}
                for r in results:
                    if r["outcome"] in ("fail", "error"):
                        kills.setdefault(r["provider"], r)
                missed = [p for p in mutant.providers if p not in kills]
                first = next(iter(kills.values()), None)
                outcomes.append(Outcome(
                    mutant.name, "survived" if missed else "killed",
                    ", ".join(f"{r['case_id']} ({p})" for p, r in kills.items()) or None, ",".join(kills),
                    (f"not killed on {', '.join(missed)} ({len(jobs)} runs)" if missed else first["message"])))
            outcomes[-1].seconds = time.perf_counter() - start
            echo(describe(outcomes[-1]))
            shutil.rmtree(work, ignore_errors=True)
    return outcomes


def describe(o: Outcome) -> str:
    head = f"{o.status.upper():<12} {o.name:<34}"
    if o.status == "killed":
        return f"{head} {o.case_id}  {o.message[:100]}  ({o.seconds:.0f} s)"
    return f"{head} {o.message}"


def main(args: argparse.Namespace) -> int:
    """``dsv4-parity mutants --impl megatron``."""
    try:
        source = locate(getattr(args, "megatron", None) or os.environ.get("DSV4_MEGATRON") or None)
    except MegatronSourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    known = {m.name for m in MUTANTS}
    if getattr(args, "list", False):
        for m in MUTANTS:
            print(f"{m.name:<34} {m.description}  [{', '.join(m.providers)}; {m.path}]")
        return 0
    unknown = [n for n in (args.mutant or []) if n not in known]
    if unknown:
        print(f"error: unknown mutant(s) {unknown} (known: {', '.join(sorted(known))})", file=sys.stderr)
        return 2
    print(f"megatron: {source.revision} ({source.root}); patches go to scratch copies")
    outcomes = run_suite(source.root, args.mutant)
    killed = sum(o.status == "killed" for o in outcomes)
    print(f"mutants: {killed}/{len(outcomes)} killed")
    return 0 if killed == len(outcomes) else 1


if __name__ == "__main__":  # the child process: python -m parity.megatron_mutants --child TREE JOBS
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        with contextlib.redirect_stdout(io.StringIO()):
            rows = _child(sys.argv[2], [tuple(j) for j in json.loads(sys.argv[3])])
        print(json.dumps(rows))
        sys.exit(0)
    sys.exit(2)
