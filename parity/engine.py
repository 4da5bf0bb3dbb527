"""Run one case: the implementation, the float64 truth and the same-dtype noise run; diff; decide.

For a case of dtype ``d`` (all runs on the same device, from the same materialised tensors):

1. ``impl``  — the implementation under test in ``d`` (inside its provider context);
2. ``truth`` — the reference in float64 on the ``d``-rounded inputs upcast, **with the implementation's top-k**
   ("split" mode, so a near-tie flip can neither fake nor hide a numeric difference downstream);
3. ``noise`` — the reference in ``d`` with the same top-k: its distance to ``truth`` is the noise floor. For a
   float64 case it *is* ``truth`` (the floor is then the policy's few ULPs).

Sign-split (:mod:`parity.judge.sign_split`): for float32 / bf16 training cases with an indexer loss, both reference runs
also take the implementation's indexer ReLU pattern (observed through its public API) where their own product is
ambiguously near 0, so a rounding-flipped sign can neither fake nor hide an indexer-gradient difference; and they
differentiate the indexer KL at the implementation's ``index_scores`` (score-split), so the forward rounding of the
scores, amplified by the cancellation in ``softmax(I) - T``, is not what sets the indexer gradients' noise floor.

The selection itself is judged by the tie-margin protocol against ``truth``'s scores (:mod:`parity.judge.topk`), and, on
exactly tied rows, by the implementation's declared tie rule (:meth:`Implementation.tie_rule`).

On a layer with a compressor or an indexer, the public ``compressor()`` / ``indexer()`` of both run too and join
the snapshots as ``api/*`` tensors (:mod:`parity.judge.api_check`).

When ``dO`` is non-zero on some THD padding row (core scope, ``padding_dout="poison"`` cases), the implementation
runs a second time with ``dO`` on the padding rows only and no loss term: every gradient must be exactly 0 (tensor
``contract/padding_dout``, rule ``contract``, :mod:`parity.judge.padding_dout`).

Outcomes: ``pass`` / ``fail`` (numeric or structural), ``error`` (an exception, e.g. a CUDA fault, or a crashed
worker), ``unsupported`` (the implementation declined the case: ``cases.vocabulary.Unsupported`` or
``NotImplementedError``, or the case needs a GPU this machine lacks).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import shlex
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, Optional

import torch

from cases.case import Case
from cases.coverage import features
from cases.errors import CaseError
from cases.tensors import materialize

from parity import backward_origin, policy as policy_mod
from parity.deviations import known, known_models
from parity.impls import Implementation, is_unsupported, policy_provider
from parity.judge import api_check, padding_dout, sign_split, structure, verdict
from parity.judge.snapshot import take_snapshot
from parity.run import out_of_memory
from parity.run.kernel_time import KernelTime
from parity.run.results import CaseResult


@dataclass
class RunOptions:
    """What to compare and where; shared by every case of a run."""

    impl: str = "fused"
    against: str = "reference"
    provider: str = "auto"      # as given on the command line
    device: str = "auto"        # auto / cpu / cuda; explicit cpu also runs the cases that ask for CUDA (gate-cpu)
    require: Optional[str] = None
    policy_path: Optional[str] = None
    cp: int = 1                 # context-parallel ranks of the implementation (megatron: production's THD CP branch)

    def torch_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def repro(self, case: Case) -> str:
        """One command re-running exactly this case with these options."""
        parts = [f"dsv4-parity run --case {shlex.quote(case.to_json())}"]
        if self.impl != "fused":
            parts.append(f"--impl {shlex.quote(self.impl)}")
        if self.against != "reference":
            parts.append(f"--against {shlex.quote(self.against)}")
        if self.provider != "auto":
            parts.append(f"--provider {self.provider}")
        if self.require:
            parts.append(f"--require {self.require}")
        if self.device != "auto":
            parts.append(f"--device {self.device}")
        if self.cp != 1:
            parts.append(f"--cp {self.cp}")
        return " ".join(parts)


def configure_torch() -> None:
    """Deterministic algorithms (the determinism oracle and reruns rely on them; ops without a deterministic
    kernel only warn) and cuBLAS's deterministic workspace. Called by the CLI and the worker, before CUDA starts.

    What ``torch.use_deterministic_algorithms(True, warn_only=True)`` sets, without the ~3 s a process its import of
    Inductor (for Inductor's ``deterministic`` option) costs: the flag itself, ``TORCHINDUCTOR_DETERMINISTIC=1`` for
    an Inductor imported later, and :func:`inductor_deterministic` for one already imported."""
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("TORCHINDUCTOR_DETERMINISTIC", "1")
    torch._C._set_deterministic_algorithms(True, warn_only=True)
    inductor_deterministic()


def inductor_deterministic() -> None:
    """Inductor's ``deterministic`` option on, where Inductor is imported (an implementation compiled with
    ``torch.compile``, whatever its environment said); nothing is imported. :func:`run_case` calls it before each
    case."""
    config = sys.modules.get("torch._inductor.config")
    if config is not None and getattr(config, "deterministic", True) is not True:
        config.deterministic = True


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _where(exc: BaseException) -> str:
    """The innermost frame outside torch / site-packages (``dir/file.py:function:line``), to make an error
    actionable. An error of a C++ backward node has no frame of the code that built the node: the engine then asks
    :func:`_backward_origin`."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if not backward_origin.is_foreign(frame.filename):
            return backward_origin.short(frame.filename, frame.name, frame.lineno)
    return ""


def _backward_origin(impl: Implementation, case: Case, run: tuple, provider: str, options: RunOptions) -> str:
    """The implementation's forward call whose backward raised (``dir/file.py:function:line (Node)``, found by an
    anomaly-mode re-run, :mod:`parity.backward_origin`), or "" when the re-run cannot tell."""
    tensors, with_loss = run
    try:
        return backward_origin.locate(impl.api, case, tensors, context=impl.context(provider, options.require),
                                      with_loss=with_loss) or ""
    except Exception:  # noqa: BLE001 — locating is best effort; the error itself is already reported
        return ""


_PHASE_OBSERVER: contextvars.ContextVar = contextvars.ContextVar("phase_observer", default=None)


@contextlib.contextmanager
def observing_phases(observer: Callable[[str], ContextManager]) -> Iterator[None]:
    """Within the block, every case run in this thread enters ``observer(phase)`` around each of its timed phases
    (``materialize``, ``impl``, ``sign_split``, ``reference``, ``compare``), inside the phase's clock: how the bench
    counts the ATen ops each phase dispatches (:mod:`bench.ops`). Cases run in worker processes are not observed."""
    token = _PHASE_OBSERVER.set(observer)
    try:
        yield
    finally:
        _PHASE_OBSERVER.reset(token)


class _PhaseClock:
    """``with clock("impl"): ...`` adds the block's wall seconds to ``seconds["impl"]``; on CUDA the device is
    synchronised at both ends, so queued kernels count in the phase that launched them. ``impl`` and ``reference``
    are the two implementations (the reference's float64 "truth" and same-dtype "noise" runs together, forward and
    backward with their snapshots); ``materialize`` and ``compare`` are the harness's own time.

    On CUDA, ``peaks[phase]`` is the most GPU memory PyTorch had allocated in this process while the phase ran (what
    the case's tensors and the phase's own work held together, ``torch.cuda.max_memory_allocated`` after a reset at
    the phase's start; the largest over a phase's blocks): what the case needs of a GPU, phase by phase, to schedule
    cases by memory and to see a change of production's footprint. A phase that ran out of memory records what was
    allocated up to the failing request (the request itself is in the error message). ``reserved[phase]`` likewise
    records ``torch.cuda.max_memory_reserved``: what the process's caching allocator held from the GPU (its cache and
    fragmentation included, blocks cached by the case's earlier phases too: not the phase's own need), which is what
    other processes sharing the GPU cannot use."""

    def __init__(self, seconds: dict, device: str, peaks: Optional[dict] = None,
                 observer: Optional[Callable[[str], ContextManager]] = None, reserved: Optional[dict] = None):
        self.seconds, self.cuda = seconds, device == "cuda"
        self.peaks = peaks if peaks is not None else {}
        self.reserved = reserved if reserved is not None else {}
        self.observer = observer

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self._sync()
        self._reset_peak()
        t0 = time.perf_counter()
        try:
            with (self.observer(phase) if self.observer else contextlib.nullcontext()):
                yield
        finally:
            self._sync()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
            self._read_peak(phase)

    def _reset_peak(self) -> None:
        if self.cuda:
            try:
                torch.cuda.reset_peak_memory_stats()
            except Exception:  # noqa: BLE001 — memory statistics are a record, never a failure of the case
                pass

    def _read_peak(self, phase: str) -> None:
        if self.cuda:
            try:
                peak, held = int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())
            except Exception:  # noqa: BLE001
                return
            self.peaks[phase] = max(self.peaks.get(phase, 0), peak)
            self.reserved[phase] = max(self.reserved.get(phase, 0), held)

    def _sync(self) -> None:
        if self.cuda:
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 — a broken context is reported by the phase itself
                pass


def run_case(case: Case, impl: Implementation, against: Implementation, options: RunOptions,
             policy: Optional[policy_mod.Policy] = None) -> CaseResult:
    """Compare ``impl`` with ``against`` on ``case``; never raises for a problem of the case or the implementations.
    Where an entry of the implementation's registry of known deviations matches the case, the case is judged again
    against the entry's deviation model: ``known`` where the implementation matches it, ``fail`` (naming the entry
    and the distance to both) where it matches neither, ``fixed?`` where it now matches the contract; a crash is
    ``known`` only by the exception type and production's raising frame (:mod:`parity.deviations.known`)."""
    inductor_deterministic()
    result, runs, raised = _decide_case(case, impl, against, options, policy)
    try:
        entries = known.registry_for(impl)
    except CaseError as exc:  # a malformed registry excuses nothing and hides no verdict: the case keeps its own
        entries = []
        result.message += f" [known-deviation registry not applied: {exc}]"
    if entries:
        try:
            provider = impl.resolve_provider(options.provider)
            info = impl.describe(provider)
            known.apply(result, entries, impl.provider_name(provider),
                        info.get("architecture") or known.architecture(options.torch_device()),
                        str(info.get("upstream_revision") or info.get("revision") or ""), runs=runs, raised=raised)
        except Exception as exc:  # noqa: BLE001 — a broken registry is reported, never hides the verdict
            if backward_origin.out_of_memory(exc):  # the machine's condition: an error a shared GPU re-runs alone
                result.outcome, result.decided_by = "error", "error"
                result.message = f"known-deviation registry: {one_line(exc)} (judging: {result.message})"
                result.first_failure = {"tensor": None, "rule": "error", "message": result.message}
            else:
                result.message += f" [known-deviation registry: {one_line(exc)}]"
    return result


@dataclass
class CaseRuns:
    """The runs a case was judged on, kept so that :func:`parity.deviations.known.apply` can judge it again against a known
    deviation's model (:mod:`parity.deviations.known_models`): the tensors, the implementation's snapshot (and its run with
    ``dO`` on padding rows only, ``contract``), the reference's truth and noise, and how they were compared."""

    case: Case
    against: Implementation
    tensors: object
    impl: object
    truth: object
    noise: object
    contract: object  # the implementation's padding-dO-only snapshot, or None (dO is 0 on every padding row)
    split: Optional[torch.Tensor]
    precision: str
    policy: policy_mod.Policy
    provider: str  # the policy's provider key
    tie_rule: str
    cp_layout: Optional[dict] = None  # the implementation's context-parallel partition of the pack (--cp N), or None

    def reference(self, tensors, with_loss: bool = True) -> tuple:
        """``(truth, noise)`` of the reference on other ``tensors`` (the implementation's top-k, no sign-split)."""
        truth, noise, _ = reference_runs(self.case, self.against, tensors, self.split, None, self.precision,
                                         with_loss=with_loss)
        return truth, noise

    def judge(self, expect) -> tuple:
        """``(tensor results, top-k report, outcome, decided_by, first_failure, message)`` of the implementation
        against ``expect`` (a :class:`parity.deviations.known_models.Expectation`; the contract's is ``truth`` / ``noise``)."""
        problems = structure.check(self.case, self.tensors, self.impl, expect.noise, expect.truth,
                                   padding_grads=expect.padding_grads, slack_forward_free=expect.slack_forward_free,
                                   slack_keys=expect.slack_keys)
        case_problems = problems.pop("*", [])
        out, report = verdict.judge_case_tensors(self.case, self.tensors, self.impl, expect.truth, expect.noise,
                                                 problems, self.policy, self.provider, self.tie_rule, self.precision,
                                                 padding_grads=expect.padding_grads)
        if self.contract is not None:
            if expect.contract is None:
                out.append(verdict.contract_tensor(padding_dout.leaks(self.contract)))
            else:
                out.append(verdict.contract_tensor_modelled(self.contract, *expect.contract, self.policy,
                                                            self.provider, self.precision))
        return (out, report) + verdict.case_decision(out, case_problems)


def _decide_case(case: Case, impl: Implementation, against: Implementation, options: RunOptions,
                 policy: Optional[policy_mod.Policy] = None) -> tuple:
    """``(result, runs, raised)``: the case judged against the contract; the :class:`CaseRuns` it was judged on (None
    when it did not get that far) and, for an exception, :func:`parity.deviations.known.raised` of it (else None)."""
    policy = policy or (policy_mod.load(options.policy_path) if options.policy_path else policy_mod.default())
    start = time.perf_counter()
    provider = impl.resolve_provider(options.provider)
    result = CaseResult(case=case, outcome="error", decided_by="error", repro=options.repro(case),
                        features=features(case))

    def finish(outcome: str, decided_by: str, message: str, runs=None, raised=None) -> tuple:
        result.outcome, result.decided_by, result.message = outcome, decided_by, message
        if outcome == "error":
            result.first_failure = {"tensor": None, "rule": "error", "message": message}
        result.duration_s = time.perf_counter() - start
        return result, runs, raised

    device = options.torch_device()
    if case.device == "cuda" and device != "cuda" and options.device == "auto":  # an explicit --device overrides
        return finish("unsupported", "device", "the case needs a CUDA device (kernel-profile shapes)")
    clock = _PhaseClock(result.phases_s, device, result.peak_gpu_bytes, _PHASE_OBSERVER.get(),
                        result.peak_gpu_reserved_bytes)
    stage, impl_run = "materialize", None
    try:
        with clock("materialize"):
            tensors = materialize(case, device)
        stage = f"{impl.name} run"
        # the implementation's kernel calls in its phase, timed (not under --cp: its ranks run in other processes)
        observe = impl.optional_hook("observe_kernels") if options.cp <= 1 else None
        timer = KernelTime(device) if observe is not None else None
        timed = (lambda: observe(timer.observe)) if timer else contextlib.nullcontext
        with clock("impl"), timed():
            impl_run = (tensors, True)  # what the impl stage ran, for locating a backward error (backward_origin)
            impl_snap = take_snapshot(impl.api, case, tensors, context=impl.context(provider, options.require))
            contract_snap = None
            if padding_dout.padding_dout_nonzero(tensors):
                stage = f"{impl.name} run with dO on padding rows only"
                impl_run = (padding_dout.padding_dout_only(tensors), False)
                contract_snap = take_snapshot(impl.api, case, impl_run[0],
                                              context=impl.context(provider, options.require), with_loss=False)
        result.plan = impl_snap.record or {}
        stage, pattern = f"{impl.name} activation pattern", None
        if sign_split.applies(case):
            with clock("sign_split"):
                pattern = observe_pattern(case, impl, tensors, provider, options, policy, impl_snap["index_scores"])
        stage = f"{against.name} runs"
        precision = impl.precision(case)
        if precision != case.dtype:
            result.precision = precision
        result.not_provided = dict(impl_snap.not_provided)
        with clock("reference"):
            truth, noise, note = reference_runs(case, against, tensors, impl_snap["topk_indices"], pattern,
                                                precision)
        if pattern is None and sign_split.applies(case):
            note = "; ".join(filter(None, (note, "no sign-split (activation pattern over sign_split.max_elements, or no index scores observed)")))
        stage = "public compressor / indexer"
        api_runs(case, impl, against, tensors, provider, options.require, impl_snap, truth, noise, clock, timed)
        if timer is not None:  # the clock synchronised the device on leaving each impl block: the events are read
            result.impl_kernels = timer.record()
    except Exception as exc:  # noqa: BLE001 — every failure of a run is an outcome, never a crash of the harness
        if is_unsupported(exc) and not stage.startswith(against.name):
            return finish("unsupported", "unsupported", one_line(exc))
        in_impl_run = stage.startswith(f"{impl.name} run")
        result.failed_at = {"stage": stage, "implementation_run": in_impl_run}
        # out of memory is the machine's condition, not the case's: an ``error``, which a shared GPU re-runs alone
        # (parity.run.worker); unless the implementation's own run needs more than the whole GPU by torch's numbers
        # (held + asked): no re-run can do the case on this GPU, as a kernel that refuses a shape cannot
        if in_impl_run and backward_origin.out_of_memory(exc) and out_of_memory.plausible_need(str(exc), alone=False):
            result.first_failure = {"tensor": None, "rule": "device-memory", "message": one_line(exc)}
            return finish("unsupported", "device-memory", out_of_memory.does_not_fit(stage, str(exc)))
        own = impl.raised_in_own_code(exc) if stage.startswith(impl.name) and \
            not backward_origin.out_of_memory(exc) else None
        if own:  # the code under test raised on a valid case: its behaviour (a failure), not a harness error
            result.first_failure = {"tensor": None, "rule": "raised", "message": one_line(exc)}
            return finish("fail", "raised", f"{stage}: {impl.name} raised in its own code: {one_line(exc)} [{own}]",
                          raised=known.raised(exc))
        where = _where(exc)
        if impl_run is not None and stage.startswith(f"{impl.name} run") and \
                backward_origin.raised_in_backward_without_frame(exc):
            origin = _backward_origin(impl, case, impl_run, provider, options)
            if origin:  # the implementation's frame first: whose code raised it
                where = f"{origin}, in its backward; raised under {where}"
        return finish("error", "error", f"{stage}: {one_line(exc)}" + (f" [{where}]" if where else ""),
                      raised=known.raised(exc) if stage.startswith(impl.name) else None)

    runs = CaseRuns(case, against, tensors, impl_snap, truth, noise, contract_snap, impl_snap["topk_indices"],
                    precision, policy, policy_provider(impl_snap.record, provider), impl.tie_rule(impl_snap.record),
                    impl.cp_layout(case) if options.cp > 1 else None)
    try:
        with clock("compare"):
            tensors_out, report, outcome, decided_by, first, message = runs.judge(
                known_models.Expectation.of_contract(truth, noise))
    except Exception as exc:  # noqa: BLE001 — a comparison crash is the harness's error, reported as such
        return finish("error", "error", f"comparison: {one_line(exc)} [{_where(exc)}]")
    result.tensors, result.first_failure = tensors_out, first
    if pattern is not None:
        record = truth.record or {}
        result.sign_split = {"adopted": record.get("relu_adopted", 0), "rejected": record.get("relu_rejected", 0),
                             "window_usage": record.get("relu_window_usage", 0.0),
                             "scores": pattern.scores is not None, "probe": pattern.probe}
    result.topk = report.summary() if report is not None else None
    ran = {p for value in result.plan.values() for p in str(value).split("+")}
    if options.require and outcome in ("pass", "fail") and options.require not in ran:
        # a failure too: without the required provider no known deviation may excuse it (found by review: a
        # registered deviation turned it `known` and the provider that never ran went unsaid)
        compared = f"; its comparison: {message}" if outcome == "fail" and message else ""
        outcome, decided_by = "fail", "require"
        message = f"required provider {options.require!r} did not run (plan: {result.plan or 'none'}){compared}"
        result.first_failure = {"tensor": None, "rule": "require", "message": message}
    if note and outcome == "fail":
        message += f" [{note}]"
    return finish(outcome, decided_by, message, runs=runs if decided_by != "require" else None)


def observe_pattern(case: Case, impl: Implementation, tensors, provider: str, options: RunOptions,
                    policy: policy_mod.Policy, scores: Optional[torch.Tensor] = None) -> Optional[sign_split.Pattern]:
    """The implementation's indexer activation pattern for sign-split, with its ``index_scores`` (``scores``, from its
    training run) for score-split, or None where it does not apply."""
    if not sign_split.applies(case):
        return None
    settings = sign_split.Settings(**policy.section("sign_split"))
    observed = sign_split.observe(impl.api, case, tensors, impl.context(provider, options.require), settings)
    if observed is None:
        return None
    active, probe = observed
    return sign_split.Pattern(active, sign_split.window(case, settings), sign_split.split_scores(active, scores),
                              probe)


def eager(fn):
    """``fn`` run with no TorchDynamo frame callback in effect: the oracle (the reference) is plain eager PyTorch,
    whatever a ``torch.compile``\'d implementation in the same worker left installed (production compiles its query
    RMS norm). Why: under a Dynamo callback the reference's checkpointed row blocks (``reference.numerics.per_block``)
    break — ``CheckpointError`` on a CPU (tests/parity/test_eager_reference.py) — and the H100 gate of 2026-12-06 had
    one reference ``CheckpointError`` (482c769e7e15 at 608545cfc6, run after production's compiled code in the same
    worker; alone it passed). That it was this is not proven; the guard costs nothing where Dynamo was never
    imported and keeps the reference out of any compiler's reach."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:  # never imported: no callback can be installed
            return fn(*args, **kwargs)
        return dynamo.disable(fn, recursive=True)(*args, **kwargs)
    return run


@eager
def reference_runs(case: Case, against: Implementation, tensors, split: Optional[torch.Tensor],
                   pattern: Optional[sign_split.Pattern] = None, precision: Optional[str] = None, *,
                   with_loss: bool = True) -> tuple:
    """``(truth, noise, note)`` in split mode (and sign-split with ``pattern``). A selection the reference cannot
    even consume (malformed ids, which the structure rule reports) falls back to the reference's own selection, so
    the other tensors are still compared; ``note`` then says so (else it is empty). ``precision`` below the case
    dtype (an implementation's declared working precision): the noise run is the reference on the case tensors
    rounded to it. ``with_loss=False``: the gradients of ``sum(out · dO)`` alone."""
    note = ""
    context = contextlib.nullcontext
    if pattern is not None:
        context = against.activation_context(pattern.active, pattern.window, pattern.scores)
        if context is None:
            context, note = contextlib.nullcontext, f"{against.name} has no sign-split hook"
    try:
        truth = take_snapshot(against.api, case, tensors, upcast=True, topk_indices=split, context=context,
                              with_loss=with_loss)
    except Exception as exc:  # noqa: BLE001
        if split is None:
            raise
        split = None
        note = "; ".join(filter(None, (note, f"split mode impossible ({one_line(exc)}); compared with the "
                                             f"reference's own selection")))
        truth = take_snapshot(against.api, case, tensors, upcast=True, context=context, with_loss=with_loss)
    if precision and precision != case.dtype:
        cast = {"float32": torch.float32, "bfloat16": torch.bfloat16}[precision]
        noise = take_snapshot(against.api, case, tensors, topk_indices=split, cast=cast, context=context,
                              with_loss=with_loss)
    else:
        noise = truth if case.dtype == "float64" else take_snapshot(against.api, case, tensors, topk_indices=split,
                                                                    context=context, with_loss=with_loss)
    return truth, noise, note


def api_runs(case: Case, impl: Implementation, against: Implementation, tensors, provider: str,
             require: Optional[str], impl_snap, truth, noise, clock=None,
             timed: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
    """Add the public compressor / indexer outputs (:mod:`parity.judge.api_check`) of ``impl`` and of ``against``
    (float64 truth and same-dtype noise) to the snapshots, when the layer has them and both implementations
    expose them."""
    if not (api_check.applies(case) and api_check.has_api(impl.api) and api_check.has_api(against.api)):
        return
    clock = clock or (lambda phase: contextlib.nullcontext())
    with clock("impl"), timed():
        api_check.merge(impl_snap, api_check.run_api(impl.api, case, tensors, context=impl.context(provider, require)))
    with clock("reference"):
        truth_api = eager(api_check.run_api)(against.api, case, tensors, upcast=True)
        api_check.merge(truth, truth_api)
        if noise is not truth:
            api_check.merge(noise, eager(api_check.run_api)(against.api, case, tensors))


def snapshots(case: Case, impl: Implementation, against: Implementation, options: RunOptions) -> tuple:
    """``(tensors, impl, truth, noise)`` snapshots of a case, for tests and interactive digging (raises)."""
    provider = impl.resolve_provider(options.provider)
    tensors = materialize(case, options.torch_device())
    impl_snap = take_snapshot(impl.api, case, tensors, context=impl.context(provider, options.require))
    pattern = observe_pattern(case, impl, tensors, provider, options, policy_mod.default(),
                              impl_snap["index_scores"])
    truth, noise, _ = reference_runs(case, against, tensors, impl_snap["topk_indices"], pattern,
                                    impl.precision(case))
    api_runs(case, impl, against, tensors, provider, options.require, impl_snap, truth, noise)
    return tensors, impl_snap, truth, noise


__all__ = ["RunOptions", "configure_torch", "observing_phases", "run_case", "snapshots"]
