"""Real-code mutants: planted bugs applied as text patches to a scratch copy of Megatron-LM (never the user's tree),
each run in a fresh process (Python imports ``megatron`` once) with ``--impl megatron`` on the cases that reach it.

A mutant is **killed** when, on every provider that executes its code, a case that is clean on the clean tree fails or
errors with the patch applied (``known`` is not a kill: a registered deviation is not the planted bug). Clean is
``pass``, or ``known``: production matching a registered deviation's model (:mod:`parity.deviations.known`), so a planted bug on a
registered tensor is caught by the model, not hidden by the registration.
``dsv4-parity mutants --impl megatron`` prints one line per mutant and ends with ``mutants: K/N killed``; it exits 0
iff every mutant was killed. A patch that no longer applies (upstream moved the line) is reported, never silently
skipped.

The catalogue (:data:`MUTANTS`): the seed's three review bugs in the fused THD code, and more across production's
PyTorch and fused paths. Each names the providers that execute its code and the smoke cases that reach it. A
context-parallel mutant (``cp > 1``) runs its cases at that CP size, and on the same cases the ``cp`` metamorphic
oracle (CP = N against CP = 1): its outcome is recorded per mutant (``oracle``), and the clean tree's must pass.
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
from typing import Callable, Optional, Sequence

import torch

from adapters.megatron import emulated, real_kernels
from adapters.megatron.source import MegatronSourceError, locate, record_revision
from cases.suites import load_suite
from parity.engine import RunOptions, configure_torch, run_case
from parity.impls import load
from parity.names import MEGATRON_MUTANTS_OUT, MUTANTS_NAME
from parity.oracles.metamorphic import run_oracle

#: where ``mutants --impl megatron`` writes without ``--out`` (not the fused suite's folder)
DEFAULT_OUT = MEGATRON_MUTANTS_OUT

VARIANT = "megatron/core/transformer/experimental_attention_variant"
FUSED = f"{VARIANT}/csa_utils/fused_sparse_attention.py"
CP_UTILS = f"{VARIANT}/csa_utils/cp_utils.py"
CSA = f"{VARIANT}/csa.py"
HYBRID = f"{VARIANT}/deepseek_v4_hybrid_attention.py"
#: the provider that runs production's fused path on a CPU; a mutant it executes also runs on the real kernels
FUSED_PATH = "emulated"


@dataclass(frozen=True)
class Mutant:
    """One planted bug: replace ``old`` (which must occur exactly once, or pick occurrence ``nth``) by ``new`` in
    ``path``; on a CPU, killed by some case of ``cases`` (smoke ids) on each of ``providers``.

    A mutant of the fused path (``emulated`` among ``providers``) also runs on the real kernels (``cudnn``): then
    ``gpu_cases`` (``gate`` ids, small enough for a CPU to check them with the emulated provider declaring
    the GPU's capability) kill it. ``unreachable`` = ``((sm major, why), ...)``: architectures where production never
    runs the mutated code (its config validation refuses every case that would), reported ``not reachable``.
    ``no_gate_case``: why a fused-path mutant has no ``gpu_cases`` (reported ``no gate case``: not killed).
    ``cp``: the context-parallel size its cases run at (``--cp``; > 1: production's THD CP branch over that many
    gloo ranks, the CPU plan only — a GPU plan runs one GPU)."""

    name: str
    description: str
    path: str
    old: str
    new: str
    providers: tuple[str, ...]
    cases: tuple[str, ...]
    nth: Optional[int] = None
    gpu_cases: tuple[str, ...] = ()
    unreachable: tuple[tuple[int, str], ...] = ()
    no_gate_case: str = ""
    cp: int = 1


#: why the THD dense-loss backward never runs on an sm90 GPU: its only caller is Path B with the dense indexer loss
SM90_DENSE_LOSS = ("production's config validation refuses the r = 4 dense indexer loss with "
                   "dsa_kernel_backend='cudnn' on SM90 (transformer_config.py), the only way into this backward")

MUTANTS: tuple[Mutant, ...] = (
    # ---- the seed's three review bugs, in the fused THD code -----------------------------------------------------
    Mutant("thd_dense_bwd_no_max_seqlen", "fused THD dense-loss indexer backward called without max_seqlen_q/k",
           FUSED,
           "                        max_seqlen_q=int(max_seqlen_q),\n"
           "                        max_seqlen_k=int(max_seqlen_compressed_idx),\n",
           "", ("emulated",), ("4094c96fb157",), gpu_cases=("b5e73394500d",), unreachable=((9, SM90_DENSE_LOSS),)),
    Mutant("fake_bshd_view_over_batch", "fused sparse-loss indexer gradient: a .view over the leading (batch) "
           "dimension instead of the permute (right only for one sequence)",
           FUSED, 'precomputed_grad_q_indexer = ig["d_index_q"].permute(1, 0, 2, 3).contiguous()',
           'precomputed_grad_q_indexer = ig["d_index_q"].view(ig["d_index_q"].shape[1], '
           'ig["d_index_q"].shape[0], *ig["d_index_q"].shape[2:])',
           ("emulated",), ("9a8dbea368d1", "2eb1db7b4212"), nth=0, gpu_cases=("eb6b0817dc4e",)),
    Mutant("invalid_comp_rows_by_count", "cat_per_segment routes invalid (capacity-padding) compressed rows by the "
           "true count instead of the capacity: onto valid kv_full rows",
           CSA, "dst_comp = torch.where(valid_comp, dst_comp, total_kv + src_comp)",
           "dst_comp = torch.where(valid_comp, dst_comp, total_kv + src_comp - cu_seqlens_compressed[-1])",
           ("unfused", "emulated"), ("6cd75c50f538", "03836235949d"), gpu_cases=("1fa00ee68a39",)),
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
           ("unfused", "emulated"), ("8f5a75c53c73", "c63c8c6d34a6"), gpu_cases=("b829be0130b6",)),
    Mutant("output_inverse_rope_dropped", "layer output: the inverse RoPE applied forward (inverse=False)",
           HYBRID, "                mla_rotary_interleaved=True,\n                inverse=True,\n"
                   "                mla_output_remove_interleaving=True,\n"
                   "                max_seqlen=rope_max_seqlen_kv,",
           "                mla_rotary_interleaved=True,\n                inverse=False,\n"
           "                mla_output_remove_interleaving=True,\n                max_seqlen=rope_max_seqlen_kv,",
           ("unfused", "emulated"), ("c63c8c6d34a6", "8f5a75c53c73"), gpu_cases=("c33c7d368b89",)),
    Mutant("compressor_real_offsets", "THD compressor: segment boundaries from the real instead of the padded "
           "cu_seqlens", CSA,
           "            cu_seqlens = (\n                packed_seq_params.cu_seqlens_q_padded\n",
           "            cu_seqlens = (\n                packed_seq_params.cu_seqlens_q\n",
           # the smallest gate case with a real segment (>= r tokens) after a padded one that passes on the clean
           # tree: the smaller ones fail production's padding-row contract (7971c6fed744, 6f068643940f) or have
           # fewer than r tokens after the shift (05430d10668b: the mutant survives it)
           ("unfused", "emulated"), ("ab101a5d94c2", "f2ceea9c0311"), gpu_cases=("7804f8058ac3",)),
    Mutant("fused_loss_coeff_ignored", "fused Path B: the indexer-loss coefficient read as 1",
           CSA, "indexer_loss_coeff = self.config.dsa_indexer_loss_coeff or 0.0",
           "indexer_loss_coeff = 1.0", ("emulated",),
           ("9a8dbea368d1", "45aaf0ad85c7"), nth=0, gpu_cases=("8d3fa957d2e2",)),
    # ---- on a registered deviation's tensors: the cases are ``known`` on the clean tree (the entry's model holds) ---
    Mutant("fused_mean_loss_extra_scale", "fused sparse indexer loss: 10 % on top of the registered mean over every "
           "packed row (fused-thd-mean-loss-over-physical-rows: its model, not its tensor names, must catch it)",
           FUSED, "    loss = kl_per_row.sum() if calculate_per_token_loss else kl_per_row.mean()\n"
                  "    return loss_coeff * loss\n",
           "    loss = kl_per_row.sum() if calculate_per_token_loss else kl_per_row.mean() * 1.1\n"
           "    return loss_coeff * loss\n",
           ("emulated",), ("f2ceea9c0311", "339801b464f2"), nth=0, gpu_cases=("ff44cb580cf3",)),
    # ---- the THD context-parallel branch (--cp 2: two gloo ranks) ----------------------------------------------
    Mutant("cp_boundary_exchange_sends_head", "CP boundary exchange: each rank sends its first D_window hidden rows "
           "to the next rank instead of its last", CP_UTILS, "send_tail = tensor[-d_window:].contiguous()",
           "send_tail = tensor[:d_window].contiguous()", ("unfused", "emulated"), ("ab101a5d94c2", "03836235949d"),
           cp=2),
    Mutant("cp_boundary_kv_rope_offset", "CP rank offset: the boundary + local KV rows roped from the rank's first "
           "row instead of D_window rows before it (unfused RoPE)", HYBRID,
           "                        global_start - boundary_rows,\n                        self.config,\n",
           "                        global_start,\n                        self.config,\n",
           ("unfused", "emulated"), ("ab101a5d94c2", "03836235949d"), cp=2),
    Mutant("cp_indexer_loss_over_buffer_rows", "CP indexer loss (unfused): the mean divided by every row of the CP "
           "buffer instead of the real rows", CSA, "                loss_divisor = cu_seqlens_q_unpadded[-1]\n",
           "                loss_divisor = l_local * cp_size\n", ("unfused",), ("f2ceea9c0311", "ab101a5d94c2"),
           cp=2),
    Mutant("cp_zero_coeff_drops_indexer_loss", "CP indexer loss skipped at coefficient 0: the indexer gets no "
           "gradient (production's contract: zero gradients, for data-parallel readiness)", CSA,
           "use_indexer_loss = training_with_grad and compressed_topk is not None",
           "use_indexer_loss = training_with_grad and compressed_topk is not None and indexer_loss_coeff > 0",
           ("unfused", "emulated"), ("51ed1802b744", "acbefb051d6e"), cp=2),
    Mutant("cp_dense_indexer_k_grad_row_dropped", "fused CP dense indexer loss: the sequence-major K gradient of the "
           "compressed row stored in rank-major slot 0 dropped (valid rows > 0 instead of >= 0)", FUSED,
           "valid_rows = indexer_rank_map >= 0", "valid_rows = indexer_rank_map > 0", ("emulated",),
           ("d24945063d10", "adeb5cfbf5cf"), cp=2),
)

#: clean-tree outcomes a kill can start from (``known``: production matches the registered deviation's model)
CLEAN = ("pass", "known")


class PatchError(RuntimeError):
    """A mutant whose patch no longer applies to this Megatron-LM revision."""


def apply(root: Path, mutant: Mutant) -> None:
    """Apply ``mutant`` to the tree at ``root`` (a scratch copy)."""
    path = root / mutant.path
    text = path.read_text(encoding="utf-8")
    count = text.count(mutant.old)
    if count == 0 or (mutant.nth is None and count != 1):
        raise PatchError(f"mutant {mutant.name}: the patched code occurs {count} times in {mutant.path} "
                         "(expected once): upstream changed; update parity/mutation/megatron_mutants.py")
    start = -1
    for _ in range((mutant.nth or 0) + 1):
        start = text.index(mutant.old, start + 1)
    path.write_text(text[:start] + mutant.new + text[start + len(mutant.old):], encoding="utf-8")


def scratch_copy(root: Path, into: Path) -> Path:
    """A copy of ``root``'s ``megatron/`` package (the user's tree is never written), recording ``root``'s revision:
    the copy is that revision plus the planted bug, so the known-deviation entries registered there apply to it."""
    target = into / "megatron-scratch"
    shutil.copytree(root / "megatron", target / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    record_revision(target, root)
    return target


# ---- child process: run cases on one tree ---------------------------------------------------------------------
def _child(tree: str, jobs: list, plan: dict) -> list:
    """``[{case_id, provider, cp, outcome, message}]`` for ``jobs`` = ``[(provider, case_id, cp), ...]`` on ``tree``: the
    cases of ``plan["suite"]`` on ``plan["device"]``; ``plan["stand_in_capability"]`` (the CPU preview of a GPU
    plan) is the device capability the emulated provider declares."""
    os.environ["DSV4_MEGATRON"] = tree
    os.environ.pop("DSV4_MEGATRON_ORIGIN", None)  # the scratch copy is this variable's, not the user's --megatron
    configure_torch()
    if plan.get("stand_in_capability"):  # the CPU preview of a GPU plan
        emulated.DEVICE_CAPABILITY = tuple(plan["stand_in_capability"])
    cases = {c.id: c for c in load_suite(plan["suite"])}
    impl, ref = load("megatron"), load("reference")
    out = []
    for provider, case_id, cp in jobs:
        options = RunOptions(impl="megatron", provider=provider, device=plan["device"], cp=cp)
        with impl.parallel(cp):
            r = run_case(cases[case_id], impl, ref, options)
            oracle = run_oracle("cp", cases[case_id], impl, options) if cp > 1 else None
        first = r.first_failure or {}
        out.append({"case_id": case_id, "provider": provider, "cp": cp, "outcome": r.outcome,
                    "message": r.message[:300], "tensor": first.get("tensor"), "check": first.get("rule"),
                    **({"oracle": oracle.outcome, "oracle_message": oracle.message[:200]} if oracle else {})})
    return out


def run_child(tree: Path, jobs: list, plan: Optional[dict] = None, timeout: float = 900.0) -> list:
    plan = plan or {"suite": "smoke", "device": "cpu"}
    env = dict(os.environ, DSV4_MEGATRON=str(tree), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "parity.mutation.megatron_mutants", "--child", str(tree), json.dumps(jobs),
                           json.dumps(plan)], capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"mutant child process failed (exit {proc.returncode}): {tail[0]}")
    return json.loads(lines[-1])


# ---- plans: which cases, where, on which providers --------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Where the mutants run. The CPU plan (default): each mutant's ``cases`` (smoke) on each of its ``providers``.
    A GPU plan: each mutant the fused path executes (``emulated`` among its providers), on its ``gpu_cases`` (gate)
    with the one ``provider`` (``cudnn``: the real kernels), judged at ``capability`` (what production refuses
    there makes a mutant :attr:`Mutant.unreachable`). ``stand_in`` previews a GPU plan on a CPU: the ``emulated``
    provider declaring ``capability`` in place of the real kernels."""

    suite: str = "smoke"
    device: str = "cpu"
    provider: Optional[str] = None
    capability: Optional[tuple[int, int]] = None
    stand_in: bool = False

    @property
    def arch(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}" if self.capability else "cpu"

    def covers(self, mutant: Mutant) -> bool:
        return self.provider is None or (FUSED_PATH in mutant.providers and mutant.cp == 1)

    def providers(self, mutant: Mutant) -> tuple[str, ...]:
        return mutant.providers if self.provider is None else (self.provider,)

    def jobs(self, mutant: Mutant) -> list:
        """``(provider, case_id, cp)`` per run of ``mutant``."""
        cases = mutant.cases if self.provider is None else mutant.gpu_cases
        return [(p, c, mutant.cp) for p in self.providers(mutant) for c in cases]

    def unreachable(self, mutant: Mutant) -> Optional[str]:
        """Why production never runs ``mutant``'s code at this plan's capability (None: it does)."""
        if self.provider is None or self.capability is None:
            return None
        return dict(mutant.unreachable).get(self.capability[0])

    def child(self) -> dict:
        return {"suite": self.suite, "device": self.device,
                "stand_in_capability": list(self.capability) if self.stand_in else None}


CPU_PLAN = Plan()


def gpu_plan(capability: tuple[int, int]) -> Plan:
    """The real kernels (``cudnn``) on the CUDA device of ``capability``, on the mutants' gate cases."""
    return Plan("gate", "cuda", "cudnn", tuple(capability))


def preview_plan(capability: tuple[int, int] = (9, 0)) -> Plan:
    """The GPU plan for ``capability`` on a CPU: the same gate cases (``--device cpu``) on the ``emulated``
    provider declaring that capability (production's config refusals and top-k alignment follow it)."""
    return Plan("gate", "cpu", "emulated", tuple(capability), stand_in=True)


# ---- the suite --------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    name: str
    status: str  # killed / survived / not applied / no clean case / no gate case / not reachable / reachable after all
    case_id: Optional[str] = None
    provider: Optional[str] = None
    message: str = ""
    seconds: float = 0.0
    tensor: Optional[str] = None  # killed: the first failing tensor of the killing case, and the rule that failed it
    check: Optional[str] = None
    oracle: Optional[str] = None  # a CP mutant: the cp oracle's outcome on its cases ("fail" on some, else "pass")

    def row(self, plan: "Plan") -> dict:
        """One ``mutants.jsonl`` row: the kill matrix's fields (``reports.mutants``; ``status`` folded into its
        three: ``killed``; ``unreachable`` only for a confirmed ``not reachable``; every other outcome is a mutant
        the suite did not kill — a stale patch, a wrong unreachable declaration, no clean case — so ``survived``, the
        status the report puts first) and this suite's own (``detail`` = the status above, where, message)."""
        folded = {"killed": "killed", "not reachable": "unreachable"}.get(self.status, "survived")
        return {"mutant": self.name, "status": folded, "case_id": self.case_id, "tensor": self.tensor,
                "check": self.check, "detail": self.status, "impl": "megatron", "provider": self.provider,
                "plan": f"{plan.provider or 'cpu'} ({plan.arch})", "message": self.message,
                "seconds": round(self.seconds, 1), **({"oracle": self.oracle} if self.oracle else {})}


def write_row(path: Path, outcome: Outcome, plan: "Plan") -> None:
    """Append ``outcome`` to ``path`` (written per mutant: a killed run keeps the mutants it judged)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(outcome.row(plan), separators=(",", ":")) + "\n")


def run_suite(source_root: Path, names: Optional[Sequence[str]] = None, echo=print,
              plan: Plan = CPU_PLAN, record: Optional[Callable[[Outcome], None]] = None) -> list[Outcome]:
    """The clean tree once, then every mutant of ``plan`` (in its own scratch copy and process). A mutant declared
    unreachable at the plan's capability is not patched: its cases must be ``unsupported`` on the clean tree
    (``not reachable``), else the declaration is wrong (``reachable after all``). ``record`` gets each outcome as it
    is judged (and ``echo`` its line)."""
    chosen = [m for m in MUTANTS if (not names or m.name in names) and plan.covers(m)]
    def tell(outcome: Outcome) -> None:
        echo(describe(outcome))
        if record is not None:
            record(outcome)

    with tempfile.TemporaryDirectory(prefix="dsv4-megatron-mutants-") as tmp:
        clean_jobs = sorted({job for m in chosen for job in plan.jobs(m)})
        clean = {(r["provider"], r["case_id"], r["cp"]): r
                 for r in (run_child(source_root, clean_jobs, plan.child()) if clean_jobs else [])}
        not_clean = [f"{p}/{c}{f' --cp {n}' if n > 1 else ''}: {r['outcome']}" for (p, c, n), r in clean.items()
                     if r["outcome"] not in CLEAN]
        not_clean += [f"{p}/{c} --cp {n}: cp oracle {r['oracle']} ({r.get('oracle_message', '')})"
                      for (p, c, n), r in clean.items() if r.get("oracle", "pass") != "pass"]
        echo(f"clean: {len(clean) - len(not_clean)}/{len(clean)} (provider, case) runs pass or are known"
             + (f"; not clean (cannot kill): {', '.join(not_clean)}" if not_clean else ""))
        outcomes = []
        for mutant in chosen:
            start = time.perf_counter()
            why = plan.unreachable(mutant)
            if plan.provider is not None and not mutant.gpu_cases:
                outcomes.append(Outcome(mutant.name, "no gate case", message=mutant.no_gate_case))
                tell(outcomes[-1])
                continue
            if why is not None:
                outcomes.append(_unreachable(mutant, why, [clean[job] for job in plan.jobs(mutant)], plan))
                tell(outcomes[-1])
                continue
            work = Path(tempfile.mkdtemp(prefix=f"{mutant.name}-", dir=tmp))
            tree = scratch_copy(source_root, work)
            try:
                apply(tree, mutant)
            except PatchError as exc:
                outcomes.append(Outcome(mutant.name, "not applied", message=str(exc)))
                tell(outcomes[-1])
                continue
            jobs = [job for job in plan.jobs(mutant) if clean[job]["outcome"] in CLEAN
                    and clean[job].get("oracle", "pass") == "pass"]
            if not jobs:
                outcomes.append(Outcome(mutant.name, "no clean case"))
            else:
                outcomes.append(_judge(mutant, plan.providers(mutant), jobs, run_child(tree, jobs, plan.child())))
            outcomes[-1].seconds = time.perf_counter() - start
            tell(outcomes[-1])
            shutil.rmtree(work, ignore_errors=True)
    return outcomes


def _judge(mutant: Mutant, providers: Sequence[str], jobs: list, results: list) -> Outcome:
    """Killed when, on every provider, some case that is clean (:data:`CLEAN`) on the clean tree fails or errors."""
    kills = {}
    for r in results:
        if r["outcome"] in ("fail", "error"):
            kills.setdefault(r["provider"], r)
    missed = [p for p in providers if p not in kills]
    first = next(iter(kills.values()), None)
    oracles = [r["oracle"] for r in results if "oracle" in r]
    return Outcome(mutant.name, "survived" if missed else "killed",
                   ", ".join(f"{r['case_id']} ({p})" for p, r in kills.items()) or None, ",".join(kills),
                   f"not killed on {', '.join(missed)} ({len(jobs)} runs)" if missed else first["message"],
                   tensor=None if missed else first.get("tensor"), check=None if missed else first.get("check"),
                   oracle=(("fail" if any(o in ("fail", "error") for o in oracles) else "pass") if oracles else None))


def _unreachable(mutant: Mutant, why: str, clean: list, plan: Plan) -> Outcome:
    """``not reachable`` when production refused every case of the mutant on the clean tree at this capability."""
    ran = [r for r in clean if r["outcome"] != "unsupported"]
    if ran or not clean:
        shown = ", ".join(f"{r['case_id']}: {r['outcome']}" for r in ran) or "no case to confirm it"
        return Outcome(mutant.name, "reachable after all",
                       message=f"declared not reachable on {plan.arch} ({why}), but the clean tree ran it: {shown}; "
                               "update Mutant.unreachable in parity/mutation/megatron_mutants.py")
    return Outcome(mutant.name, "not reachable", ",".join(r["case_id"] for r in clean),
                   message=f"on {plan.arch}: {why} (clean: {clean[0]['case_id']} unsupported)")


def describe(o: Outcome) -> str:
    head = f"{o.status.upper():<12} {o.name:<34}"
    if o.status == "killed":
        oracle = f"  [cp oracle: {o.oracle}]" if o.oracle else ""
        return f"{head} {o.case_id}  {o.message[:100]}{oracle}  ({o.seconds:.0f} s)"
    return f"{head} {o.message}"


def plan_of(args: argparse.Namespace) -> Plan:
    """``--provider``: none (torch / auto) = the CPU plan; ``cudnn`` = the GPU plan on this CUDA device;
    ``emulated`` = its CPU preview at ``--capability`` (default 9.0, the H200). Raises ValueError (the message
    names the option) for any other provider or a cudnn plan without the real kernels."""
    provider = getattr(args, "provider", None) or "torch"
    if provider in ("torch", "auto"):
        return CPU_PLAN
    if provider == "cudnn":
        why = real_kernels.unavailable_reason()
        if why is not None:
            raise ValueError(f"--provider cudnn: {why}")
        return gpu_plan(torch.cuda.get_device_capability())
    if provider == FUSED_PATH:
        return preview_plan(parse_capability(getattr(args, "capability", None) or "9.0"))
    raise ValueError(f"--provider {provider}: --impl megatron mutants run the CPU plan (no --provider), the real "
                     "kernels (--provider cudnn) or their CPU preview (--provider emulated)")


def parse_capability(text: str) -> tuple[int, int]:
    """``"9.0"`` -> ``(9, 0)``."""
    major, dot, minor = text.partition(".")
    if not (major.isdigit() and (not dot or minor.isdigit())):
        raise ValueError(f"--capability {text!r}: expected MAJOR.MINOR, e.g. 9.0 (H200) or 10.0 (B200)")
    return int(major), int(minor or 0)


def summary(outcomes: Sequence[Outcome], plan: Plan) -> tuple[str, bool]:
    """The last line and whether every mutant the plan can reach was killed (and every declared unreachable one
    confirmed)."""
    away = [o.name for o in outcomes if o.status == "not reachable"]
    judged = len(outcomes) - len(away)
    killed = sum(o.status == "killed" for o in outcomes)
    line = f"mutants: {killed}/{judged} killed"
    if plan.provider is not None:
        line += f" on {plan.provider} ({plan.arch}{', stand-in' if plan.stand_in else ''})"
    if away:
        line += f"; {len(away)} not reachable on {plan.arch}: {', '.join(away)}"
    return line, killed == judged


def main(args: argparse.Namespace) -> int:
    """``dsv4-parity mutants --impl megatron [--provider cudnn | emulated [--capability 9.0]]``."""
    try:
        source = locate(getattr(args, "megatron", None) or None)  # else DSV4_MEGATRON, named as such
        plan = plan_of(args)
    except (MegatronSourceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    known = {m.name for m in MUTANTS}
    if getattr(args, "list", False):
        for m in MUTANTS:
            print(f"{m.name:<34} {m.description}  [{', '.join(m.providers)}; {m.path}]")
            if plan.provider is not None and plan.covers(m):
                why = plan.unreachable(m)
                print(f"{'':<34} {plan.provider} ({plan.arch}): "
                      + (f"not reachable: {why}" if why else f"gate cases {', '.join(m.gpu_cases)}"))
        return 0
    unknown = [n for n in (args.mutant or []) if n not in known]
    if unknown:
        print(f"error: unknown mutant(s) {unknown} (known: {', '.join(sorted(known))})", file=sys.stderr)
        return 2
    print(f"megatron: {source.revision} ({source.root}); patches go to scratch copies")
    if plan.provider is not None:
        left = [m.name for m in MUTANTS if (not args.mutant or m.name in args.mutant) and not plan.covers(m)]
        print(f"plan: {plan.provider} on {plan.device} ({plan.arch}{', emulated kernels' if plan.stand_in else ''}), "
              f"gate cases; the fused path's mutants only" + (f" (not: {', '.join(left)})" if left else ""))
        if not any(plan.covers(m) for m in MUTANTS if not args.mutant or m.name in args.mutant):
            print("error: --mutant: none of the chosen mutants is in the fused path", file=sys.stderr)
            return 2
    out = Path(getattr(args, "out", None) or DEFAULT_OUT) / MUTANTS_NAME  # --out, else this suite's own folder
    out.unlink(missing_ok=True)  # never leave a previous run's rows next to this run's
    outcomes = run_suite(source.root, args.mutant, plan=plan, record=lambda o: write_row(out, o, plan))
    line, ok = summary(outcomes, plan)
    print(f"results: {out}")
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":  # the child process: python -m parity.mutation.megatron_mutants --child TREE JOBS
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        with contextlib.redirect_stdout(io.StringIO()):
            rows = _child(sys.argv[2], [tuple(j) for j in json.loads(sys.argv[3])], json.loads(sys.argv[4]))
        print(json.dumps(rows))
        sys.exit(0)
    sys.exit(2)
