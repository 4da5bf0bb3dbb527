"""Rule 1 of the verdict: exact structural checks of an implementation's run (no tolerance).

* presence parity: a tensor (loss, top-k, a gradient) exists in both runs or in neither (a missing gradient equals
  an all-zero one: autograd returns None for a leaf the graph does not reach) — except the indexer's parameters at
  indexer-loss coefficient 0 (a real training value): wherever the reference has them they must be present and
  exactly 0 (production's contract, its CP test ``test_thd_cp_zero_indexer_loss_keeps_indexer_grads``: a zero loss
  still marks every indexer parameter ready for data-parallel reduction, else an overlapped DDP waits forever);
* identical metadata: shape and dtype equal to the same-dtype reference's; inputs, parameters and the THD
  ``cu_seqlens`` tensors left unmodified;
* finiteness: ``out`` / ``lse`` on real rows, every gradient, the loss; no NaN anywhere in the scores, and the
  ``-inf`` pattern of ``index_scores`` on real rows equal to the reference's (causal validity);
* padding conventions: input gradients exactly 0 on padding and slack rows; slack rows (past the last boundary)
  give ``out == 0`` and ``lse == -inf``;
* top-k conventions on real rows: width ``K``, int64, ids ascending then ``-1`` padding, exactly
  ``min(K, #valid)`` real entries, each a causally valid column.

:func:`check` returns ``{tensor name: [problem, ...]}``; the key ``"*"`` holds case-level problems.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional
import torch

from cases.case import Case
from cases.tensors import CaseTensors

from parity.judge.location import first_where, row_mask
from parity.judge.snapshot import (INPUT_ORDER, RealRows, Snapshot, is_row_tensor, on_host, other_rows, read_flags,
                                   real_rows, role, scores_of)


INDEXER_GRADS = "grad/core_attention.indexer."


def zero_coeff_problems(grad) -> list[str]:
    """An indexer parameter's gradient at indexer-loss coefficient 0: present and exactly 0 (module docstring)."""
    if grad is None:
        return ["no gradient at indexer loss coefficient 0: the indexer must keep its (zero) gradients, so that "
                "data-parallel training still marks the parameter ready"]
    nonzero = int((grad != 0).sum())
    return [f"{nonzero} non-zero elements at indexer loss coefficient 0"] if nonzero else []


def _fmt_dtype(x: torch.Tensor) -> str:
    return str(x.dtype).removeprefix("torch.")


def topk_problems(idx: torch.Tensor, scores: torch.Tensor, k: int) -> list[str]:
    """Convention problems of a selection ``idx [R, k]`` against reference scores ``[R, C]`` (``-inf`` invalid).

    Checked where ``scores`` are (a CUDA run's on the GPU): every row's flags first, read back in one transfer; only a
    selection that breaks a convention reads more (its first offending row)."""
    problems = []
    if idx.dtype != torch.int64:
        problems.append(f"dtype {_fmt_dtype(idx)}, expected int64")
    if idx.dim() != 2 or idx.shape[1] != k:
        return problems + [f"width {tuple(idx.shape)[1:]} != K={k}"]
    R, C = scores.shape
    idx = idx.to(device=scores.device, dtype=torch.int64)
    real = idx >= 0
    n_valid = torch.isfinite(scores).sum(1)
    count = real.sum(1)
    picked = torch.gather(scores, 1, idx.clamp(0, C - 1)) if C else torch.zeros_like(idx, dtype=scores.dtype)
    rows = {  # per row: the convention it breaks (the range first: the others assume ids in range)
        "range": ((idx < -1) | (idx >= C)).any(1),
        "prefix": (real[:, 1:] & ~real[:, :-1]).any(1),  # real entries form a prefix
        "ascending": ~((idx[:, 1:] > idx[:, :-1]) | ~real[:, 1:]).all(1),
        "count": count != n_valid.clamp_max(k),
        "invalid": (real & ~torch.isfinite(picked)).any(1) if C else torch.zeros_like(count, dtype=torch.bool),
    }
    broken = dict(zip(rows, torch.stack(list(rows.values())).any(1).tolist()))
    says = {  # what each broken convention's first row reads (read only for a broken selection)
        "range": lambda r: f"ids {idx[r].tolist()} outside [-1, {C})",
        "prefix": lambda r: f"-1 padding is not at the end: {idx[r].tolist()}",
        "ascending": lambda r: f"ids not strictly ascending: {idx[r].tolist()}",
        "count": lambda r: f"{int(count[r])} real entries, expected min(K={k}, {int(n_valid[r])} valid)",
        "invalid": lambda r: f"selects causally invalid columns: {idx[r].tolist()}",
    }
    for kind, say in says.items():
        if broken[kind]:
            row = int(rows[kind].nonzero()[0, 0])
            problems.append(f"row {row}: {say(row)}")
            if kind == "range":
                return problems  # the other checks assume ids in range
    return problems


def slack_out_outside(out: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Where a freed slack row's ``out`` (``[T, H, D]``) is not a weight in ``(0, 1]`` times the key row it attends
    (``keys`` ``[T, D]``, :mod:`parity.deviations.known_models`): larger in magnitude than that row or of the other
    sign (0 is always inside: the weight may underflow). The quotient's one rounding may carry ``|out|`` past the key
    by a unit of ``out``'s precision, so ``|kv| · (1 + 2 eps)`` is the bound; a key of 0 admits only 0. Bool, like
    ``out``."""
    k = keys.to(device=out.device, dtype=out.dtype).unsqueeze(-2)
    eps = torch.finfo(out.dtype).eps
    return (out.abs() > k.abs() * (1 + 2 * eps)) | (torch.sign(out) * torch.sign(k) < 0) | ~torch.isfinite(out)


def _suspects(impl: Snapshot, truth: Snapshot, mask: torch.Tensor, slack, padding_grads: bool,
              slack_forward_free: bool, slack_keys: Optional[torch.Tensor] = None) -> set:
    """The tensors of ``impl`` on which some value check of :func:`check` would report a problem, screened where the
    tensors are (one boolean per tensor, read back in one transfer): only these are copied to the host, where
    :func:`check` words the problem and locates it. Each flag is the disjunction of exactly the conditions the
    checks test, so a tensor the screen passes has no problem to report."""
    flags: dict[str, torch.Tensor] = {}
    all_real = bool(mask.all())
    slack_rows = slack is not None and bool(slack.any()) and not slack_forward_free
    for name in impl.names:
        a = impl[name]
        if a is None or role(name) == "topk_indices" or name in impl.not_provided:
            continue
        a = a.detach()
        bad = torch.zeros((), dtype=torch.bool, device=a.device)
        if is_row_tensor(name) and tuple(a.shape[:mask.dim()]) != tuple(mask.shape):
            flags[name] = ~bad  # not laid out by rows: the checks decide on the host
            continue
        real = row_mask(mask, a) if is_row_tensor(name) else None
        if a.is_floating_point():
            if role(name) in ("out", "lse"):
                bad = bad | (~torch.isfinite(a) & real).any()
                if slack_rows:
                    want = 0.0 if role(name) == "out" else float("-inf")
                    bad = bad | ((a != want) & row_mask(slack, a)).any()
                elif slack is not None and slack_forward_free:  # the model's slack rows attend one key: finite
                    bad = bad | (~torch.isfinite(a) & row_mask(slack, a)).any()
                    if role(name) == "out" and _bounds(slack_keys, a):
                        bad = bad | (slack_out_outside(a, slack_keys) & row_mask(slack, a)).any()
                    elif role(name) == "out" and slack_keys is not None:
                        bad = bad | torch.ones_like(bad)  # a bound that does not fit: said on the host
            else:
                bad = bad | torch.isnan(a).any()
                if role(name) == "index_scores":
                    t = truth[name]
                    if t is not None and t.shape != a.shape:
                        bad = ~bad
                    elif t is not None:
                        bad = bad | ((torch.isfinite(a) != torch.isfinite(t.to(a.device))) & real).any()
                    bad = bad | torch.isposinf(a).any()
                else:
                    bad = bad | ~torch.isfinite(a).all()
        if name.startswith("grad/") and name[5:] in INPUT_ORDER and not padding_grads and not all_real:
            bad = bad | ((a != 0) & row_mask(~mask, a)).any()
        flags[name] = bad
    return {name for name, hit in read_flags(flags).items() if hit}


def _bounds(keys: Optional[torch.Tensor], out: torch.Tensor) -> bool:
    """Whether ``keys`` (``[T, D]``) bound an ``out`` of shape ``[T, H, D]``."""
    return (keys is not None and out.dim() == 3 and tuple(keys.shape) == (out.shape[0], out.shape[2]))


def check(case: Case, tensors: CaseTensors, impl: Snapshot, expect: Snapshot, truth: Snapshot, *,
          padding_grads: bool = False, slack_forward_free: bool = False,
          slack_keys: Optional[torch.Tensor] = None) -> dict[str, list]:
    """Structural problems of ``impl`` (``expect``: same-dtype reference, ``truth``: float64 reference).
    ``padding_grads``: gradients on padding rows are expected (a known deviation's model that keeps their ``dO``,
    :mod:`parity.deviations.known_models`): the "exactly 0 on padding rows" check is left to the numeric comparison.
    ``slack_forward_free``: a model frees the slack rows' forward values (finite still); ``slack_keys`` (``[T, D]``)
    then bounds their ``out`` (:func:`slack_out_outside`)."""
    problems: dict[str, list] = defaultdict(list)
    mask = tensors.real_rows.cpu()
    slack = torch.tensor([k == "slack" for k in tensors.row_kinds], dtype=torch.bool) if tensors.row_kinds else None
    for what in impl.mutated:
        problems["*"].append(f"the implementation modified {what} in place")
    zero_coeff = case.computes_loss and case.config.dsa_indexer_loss_coeff == 0
    suspects = _suspects(impl, truth, mask, slack, padding_grads, slack_forward_free, slack_keys)
    real = RealRows(mask)  # the top-k checks' real rows, gathered where the tensors are
    # host copies, made in one go: the tensors the screen flagged (the top-k conventions are checked on the device)
    host = on_host({n: impl[n] for n in impl.names if role(n) != "topk_indices" and n in suspects})

    for name in dict.fromkeys(expect.names + impl.names):
        if name in impl.not_provided:
            continue  # the implementation declares it has no such tensor (reported on the case row)
        a, e = impl[name], expect[name]
        if zero_coeff and name.startswith(INDEXER_GRADS) and e is not None:
            problems[name] += zero_coeff_problems(a)
            if a is None or problems[name]:
                continue
        if (a is None) != (e is None):
            present = a if a is not None else e
            if name.startswith("grad/") and not bool((present != 0).any()):
                continue  # no gradient and an all-zero one are the same value (autograd's None for an unused leaf)
            problems[name].append("missing in the implementation" if a is None else
                                  "returned by the implementation but not by the reference")
            continue
        if a is None:
            continue
        if tuple(a.shape) != tuple(e.shape):
            problems[name].append(f"shape {tuple(a.shape)} != reference {tuple(e.shape)}")
            continue
        if a.dtype != e.dtype:
            problems[name].append(f"dtype {_fmt_dtype(a)} != reference {_fmt_dtype(e)}")
        if role(name) == "topk_indices" or name not in suspects:
            continue  # top-k: below, needs the scores; not flagged by the screen: none of the checks below fires
        a = host[name]
        if a.is_floating_point() and torch.isnan(a).any() and name != "out" and name != "lse":
            problems[name].append(f"{int(torch.isnan(a).sum())} NaN values"
                                  + first_where(case, name, torch.isnan(a), is_row_tensor(name)))
            continue
        if role(name) in ("out", "lse"):
            ar = real_rows(a, mask)
            if not torch.isfinite(ar).all():
                problems[name].append(f"{int((~torch.isfinite(ar)).sum())} non-finite values on real rows"
                                      + first_where(case, name, ~torch.isfinite(a) & row_mask(mask, a), True))
            if slack is not None and slack.any() and not slack_forward_free:
                sr = real_rows(a, slack)
                want = 0.0 if name == "out" else float("-inf")
                if not bool((sr == want).all()):
                    problems[name].append(f"slack rows (past the last boundary) are not {want:g}")
            elif slack is not None and slack.any() and not torch.isfinite(real_rows(a, slack)).all():
                # a model frees the slack rows' values, not their finiteness: each attends one key and the sink
                problems[name].append(f"{int((~torch.isfinite(real_rows(a, slack))).sum())} non-finite values on "
                                      "slack rows (the known-deviation model lets them attend one key: finite)")
            elif slack is not None and slack.any() and name == "out" and slack_keys is not None \
                    and not _bounds(slack_keys, a):
                problems[name].append(f"the known-deviation model's slack-row bound (key rows "
                                      f"{tuple(slack_keys.shape)}) does not fit out {tuple(a.shape)}: not checked")
            elif slack is not None and slack.any() and name == "out" and _bounds(slack_keys, a):
                outside = slack_out_outside(a, slack_keys.cpu()) & row_mask(slack, a)
                if outside.any():
                    problems[name].append(
                        f"{int(outside.sum())} values on slack rows outside the known-deviation model's bound (a "
                        "slack row attends one key and the sink: out = w · kv[key], 0 < w <= 1)"
                        + first_where(case, name, outside, True))
        elif role(name) == "index_scores":
            t = truth[name]
            if t is not None:
                fa, ft = torch.isfinite(real_rows(a, mask)), torch.isfinite(real_rows(t.detach().cpu(), mask))
                if not torch.equal(fa, ft):
                    problems[name].append(f"finite (causally valid) pattern differs on {int((fa != ft).sum())} "
                                          "real-row entries")
                if torch.isposinf(a).any():
                    problems[name].append("+inf scores")
        elif not torch.isfinite(a).all():
            problems[name].append(f"{int((~torch.isfinite(a)).sum())} non-finite values"
                                  + first_where(case, name, ~torch.isfinite(a), is_row_tensor(name)))
        if name.startswith("grad/") and name[5:] in INPUT_ORDER and not padding_grads and not bool(mask.all()):
            pad = other_rows(a, mask)
            if (pad != 0).any():
                problems[name].append(f"gradient on padding rows is not exactly 0 ({int((pad != 0).sum())} "
                                      "non-zero elements" + first_where(case, name, (a != 0) & ~row_mask(mask, a), True)
                                      + ")")

    for name in [n for n in impl.names if role(n) == "topk_indices"]:
        idx, scores = impl[name], truth[scores_of(name)]
        if idx is None or problems.get(name):
            continue
        if scores is None:
            problems[name].append(f"the reference returned no {scores_of(name)} to check the selection against")
        else:
            k = case.config.dsa_indexer_topk
            ir = real.of(idx.detach().to(scores.device))
            sr = real.of(scores.detach().to(torch.float64))
            problems[name] += topk_problems(ir.reshape(ir.shape[0], -1) if ir.dim() > 1 else ir, sr, k)
    return {k: v for k, v in problems.items() if v}
