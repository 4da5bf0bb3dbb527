"""ATen ops per case and phase (``dsv4-parity bench --sections ops``): the launch count of the harness, on any device.

A PR gate on the GPU is launch-bound where its phases issue many small ops (the reference's float64 truth and its
same-dtype twin, block by block; the structure and metric checks; sign-split's eval forwards), and an op count does
not depend on the machine or on what else shares it. So this section runs ``--harness-suite`` cases
(``--harness-limit`` of them, spread over the suite) in this process through the engine (:func:`parity.engine.run_case`,
the fused path against the reference, ``--provider``), and counts every ATen op each timed phase dispatches
(:func:`parity.engine.observing_phases`):

* an op is one call that reaches ATen's dispatcher below autograd (a ``TorchDispatchMode`` sees it), forward and
  backward alike; views and metadata ops (:data:`FREE`: ``view``, ``expand``, ``transpose``, ``detach``, ``slice`` …)
  launch nothing and are not counted, so on CUDA nearly every counted op is one kernel launch (a few launch two,
  a few none);
* not counted: kernels that do not go through ATen (the providers' cuDNN / FlashMLA / CuTe-DSL calls on CUDA,
  compiled graphs' fused kernels), and host work between ops;
* ``sites``: for the phases named in ``SITE_PHASES`` (the reference; compare), each op is attributed to the innermost
  frame of the phase's directory (``reference/``; ``parity/judge/``) that issued it
  (``sparse_attention.py:sum_rows_in_order``) — what to cut first;
  an op of a built-in autograd node's backward has no such frame: it is ``(backward of <the repository frame that
  called backward>)``.

Reported per phase: ops summed over the cases, ops per case (mean and max, with the case), the most frequent ops, and
the host reads per case (:class:`HostReads`: each a wait for the GPU on CUDA).
Counting slows the run (a Python call per op), so the phases' seconds here are not the harness section's.
"""

from __future__ import annotations

import collections
import contextlib
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

#: ATen ops that only make views or change metadata: no kernel runs (not counted)
FREE = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "reshape", "view_as", "as_strided", "alias", "detach", "lift_fresh",
    "expand", "expand_as", "t", "transpose", "permute", "unsqueeze", "squeeze", "select", "slice", "narrow", "split",
    "split_with_sizes", "unbind", "chunk", "diagonal", "unfold", "movedim", "real", "imag", "conj",
})
REPO_ROOT = str(Path(__file__).resolve().parents[1]) + "/"
#: phases whose ops are attributed to a site: the innermost frame under the phase's directory
SITE_PHASES = {"reference": REPO_ROOT + "reference/", "compare": REPO_ROOT + "parity/judge/"}
TOP = 12


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while active (``ops``: name -> count, :data:`FREE` left out); with ``sites``,
    also by the innermost frame under ``site_root`` (``file.py:function``; ``(other)`` when none)."""

    def __init__(self, sites: bool = False, site_root: str = SITE_PHASES["reference"]):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()
        self.want_sites, self.site_root = sites, site_root

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in FREE:
            self.ops[name] += 1
            if self.want_sites:
                self.sites[self._site()] += 1
        return func(*args, **(kwargs or {}))

    def _site(self) -> str:
        """The innermost frame under ``site_root``; else ``(backward of …)`` for an op an autograd backward ran
        (a built-in node's, run below the Python frame that called ``backward``), else ``(other: …)``, each naming
        the innermost frame of this repository."""
        stack = traceback.extract_stack(limit=64)
        in_backward = False
        for frame in reversed(stack):
            if frame.filename == __file__:  # the counter's own frames
                continue
            if frame.filename.startswith(self.site_root):
                return f"{Path(frame.filename).name}:{frame.name}"
            if frame.name == "_engine_run_backward":
                in_backward = True
            if frame.filename.startswith(REPO_ROOT) and "/.venv/" not in frame.filename:
                where = f"{Path(frame.filename).relative_to(REPO_ROOT)}:{frame.name}"
                return f"(backward of {where})" if in_backward else f"(other: {where})"
        return "(other)"

    @property
    def total(self) -> int:
        return sum(self.ops.values())


_READS = {"__float__", "__int__", "__bool__", "__index__", "item", "tolist", "numpy", "cpu", "equal", "nonzero",
          "masked_select", "allclose"}


def _to_host(args, kwargs) -> bool:
    """A ``.to`` that names the host as a string (``"cpu"``, ``device="cpu"``): the harness's transfers to the host.
    A ``torch.device`` target is another tensor's device (``x.to(y.device)``), which on a CPU run is the host
    without being a host read on CUDA: not counted."""
    targets = list(args[1:]) + [kwargs.get("device")]
    return any(isinstance(t, str) and torch.device(t).type == "cpu" for t in targets if t is not None)


class HostReads(TorchFunctionMode):
    """The host reads a piece of code makes, counted on any device (on CUDA each one waits for the GPU):
    ``float()`` / ``int()`` / ``bool()`` / ``.item()`` / ``.tolist()`` / ``.numpy()`` of a tensor, ``.cpu()`` and
    ``.to("cpu")`` (:func:`_to_host`), ``torch.equal``, ``nonzero`` / ``masked_select`` and boolean-mask indexing
    (their output size is only known on the host). ``with HostReads() as reads: ...``; ``reads.total`` and ``reads.by_op`` afterwards."""

    def __init__(self):
        super().__init__()
        self.by_op: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS or (name == "to" and _to_host(args, kwargs)) or (
                name == "__getitem__" and len(args) > 1 and isinstance(args[1], torch.Tensor)
                and args[1].dtype == torch.bool):
            self.by_op[name] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())


class PhaseCounts:
    """The observer :func:`parity.engine.observing_phases` takes: one :class:`OpCounter` and one :class:`HostReads`
    per phase entry, summed into ``per_phase`` (phase -> op counter), ``sites`` (phase -> site counter) and ``reads``
    (phase -> host reads) of the current case."""

    def __init__(self):
        self.per_phase: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.sites: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.reads: collections.Counter = collections.Counter()

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        counter = OpCounter(sites=phase in SITE_PHASES, site_root=SITE_PHASES.get(phase, ""))
        reads = HostReads()
        try:
            with reads, counter:
                yield
        finally:
            self.per_phase[phase].update(counter.ops)
            self.sites[phase].update(counter.sites)
            self.reads[phase] += reads.total


def count_case(case, options, impl=None, against=None) -> tuple[Any, PhaseCounts]:
    """``(result, counts)`` of one case run through the engine with every phase's ops counted (``impl`` /
    ``against``: the loaded ``options.impl`` / ``options.against``, loaded here when not given)."""
    from parity import engine, impls

    impl = impl or impls.load(options.impl)
    against = against or impls.load(options.against)
    counts = PhaseCounts()
    with engine.observing_phases(counts):
        result = engine.run_case(case, impl, against, options)
    return result, counts


def ops_section(s: Any, log: Callable[[str], None], deadline: Optional[float] = None) -> dict:
    """The ``ops`` section: ``s.harness_suite`` (``s.harness_limit`` cases spread over it), each case's ops per phase.

    Returns ``suite cases suite_cases status phases{phase: {ops ops_per_case max_per_case max_case
    host_reads_per_case top[[op n]]}} sites{phase: [[site n]]} rows[{case outcome ops{phase: n} host_reads{phase:
    n}}]``; stops (``status`` "partial") at ``deadline``."""
    from bench.harness import spread_cases
    from cases.suites import load_suite
    from parity import impls
    from parity.engine import RunOptions

    suite = load_suite(s.harness_suite)
    chosen = spread_cases(suite, s.harness_limit)
    options = RunOptions(impl="fused", against="reference", provider=s.provider_for("fused"), device=s.device)
    fused, reference = impls.load("fused"), impls.load("reference")
    per_phase: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    sites: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    rows, status = [], "ok"
    for case in chosen:
        if deadline is not None and time.monotonic() > deadline:
            status = "partial"
            break
        result, counts = count_case(case, options, fused, reference)
        for phase, ops in counts.per_phase.items():
            per_phase[phase].update(ops)
        for phase, where in counts.sites.items():
            sites[phase].update(where)
        rows.append({"case": case.id, "outcome": result.outcome,
                     "ops": {phase: sum(ops.values()) for phase, ops in counts.per_phase.items()},
                     "host_reads": dict(counts.reads)})
    if not rows:
        return {"suite": s.harness_suite, "status": "skipped", "message": "time budget", "cases": 0}
    phases = {}
    for phase, ops in per_phase.items():
        totals = [(r["ops"].get(phase, 0), r["case"]) for r in rows]
        most, most_case = max(totals)
        reads = sum(r["host_reads"].get(phase, 0) for r in rows)
        phases[phase] = {"ops": sum(ops.values()), "ops_per_case": sum(ops.values()) / len(rows),
                         "max_per_case": most, "max_case": most_case, "host_reads_per_case": reads / len(rows),
                         "top": [[name, n] for name, n in ops.most_common(TOP)]}
    total = sum(p["ops"] for p in phases.values())
    log(f"ops {s.harness_suite}: {len(rows)} cases, {total / len(rows):.0f} ATen ops a case "
        + ", ".join(f"{k} {v['ops_per_case']:.0f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]["ops"])))
    return {"suite": s.harness_suite, "status": status, "cases": len(rows), "suite_cases": len(suite),
            "device": s.device, "torch": torch.__version__, "ops_per_case": total / len(rows), "phases": phases,
            "sites": {phase: [[k, n] for k, n in where.most_common(TOP)] for phase, where in sites.items() if where},
            "rows": rows}
