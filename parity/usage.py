"""Usage checks of a run's options, made before any case runs (each a :class:`CaseError` naming the option).

* ``--budget-s`` and ``--timeout`` must be positive (``--budget-s 0`` would start nothing, ``--timeout 0`` kill
  every case), ``--limit`` at least 1 (a green run of 0 cases proves nothing);
* ``--policy`` must be a readable, valid tolerance policy (otherwise every case would end in the same error);
* every case must fit in memory by a lower bound (:func:`check_memory`), instead of failing after minutes of drawing
  tensors.
"""

from __future__ import annotations

import argparse
import math
from typing import Optional

from cases.errors import CaseError
from cases.tensors import input_shapes, output_shape, parameter_shapes

from .policy import load as load_policy


def _positive(args: argparse.Namespace, dest: str, option: str, what: str) -> None:
    value = getattr(args, dest, None)
    if value is not None and not value > 0:
        raise CaseError(option, f"must be {what}, got {value:g}")


def check_run_options(args: argparse.Namespace) -> None:
    _positive(args, "budget_s", "--budget-s", "a positive number of seconds")
    _positive(args, "timeout", "--timeout", "a positive number of seconds")
    _positive(args, "limit", "--limit", "at least 1")
    if getattr(args, "policy", None):
        try:
            load_policy(args.policy)
        except (OSError, UnicodeDecodeError) as exc:
            raise CaseError("policy", f"cannot read {args.policy}: {getattr(exc, 'strerror', None) or exc}") from None
        except (AttributeError, TypeError):
            raise CaseError("policy", f"{args.policy} is not a tolerance policy (see parity/policy.json)") from None


# ---- memory --------------------------------------------------------------------------------------------------------
def input_bytes(case) -> int:
    """Bytes of a case's inputs, parameters and output gradient drawn in float64 (how :func:`cases.tensors.materialize`
    draws them, on the host, before casting)."""
    shapes = [*input_shapes(case).values(), *parameter_shapes(case.config, case.scope).values(), output_shape(case)]
    return 8 * sum(math.prod(s) for s in shapes)


def host_available_bytes() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def device_total_bytes() -> Optional[int]:
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def check_memory(cases, device: str, host: Optional[int] = None, gpu: Optional[int] = None) -> None:
    """Refuse, before the first case, cases whose *lower bound* of memory exceeds what the host (or GPU) offers: the
    float64 draws of every input on the host, and the float64 truth run's inputs and their gradients (twice the
    draws) wherever the cases run. The real peak is higher (activations); this only catches cases that cannot fit."""
    host = host_available_bytes() if host is None else host
    gpu = (device_total_bytes() if device == "cuda" else None) if gpu is None else gpu
    limits = [("host", host, 1 if device == "cuda" else 2)] + ([("GPU", gpu, 2)] if gpu else [])
    for where, available, copies in limits:
        if not available:
            continue
        too_big = [(c, copies * input_bytes(c)) for c in cases if copies * input_bytes(c) > available]
        if too_big:
            case, need = max(too_big, key=lambda item: item[1])
            raise CaseError("case", f"{len(too_big)} case(s) cannot fit in {where} memory, e.g. {case.id}: at least "
                                    f"{need / 2**30:.1f} GiB (its float64 inputs{' and gradients' if copies == 2 else ''}"
                                    f") against {available / 2**30:.1f} GiB available; run them on a larger machine "
                                    "or leave them out (--case-id)")
