"""Usage checks of a run's options, made before any case runs (each a :class:`CaseError` naming the option), and
before torch is loaded (this module imports none of it):

* ``--budget-s`` and ``--timeout`` must be positive (``--budget-s 0`` would start nothing, ``--timeout 0`` kill
  every case), ``--limit`` at least 1 (a green run of 0 cases proves nothing), ``--threads`` at least 1;
* ``--workers`` is a positive integer or ``auto`` (:func:`parse_workers`);
* ``--policy`` must be a readable, valid tolerance policy (otherwise every case would end in the same error).

Whether every case fits in memory is :mod:`parity.run.memory` (it needs the cases).
"""

from __future__ import annotations

import argparse
from typing import Union

from cases.errors import CaseError

from parity.policy import load as load_policy


def _positive(args: argparse.Namespace, dest: str, option: str, what: str) -> None:
    value = getattr(args, dest, None)
    if value is not None and not value > 0:
        raise CaseError(option, f"must be {what}, got {value:g}")


def parse_workers(value: Union[int, str, None]) -> Union[int, str]:
    """``"auto"`` or a positive int, from the command line value (``None`` = 1)."""
    if value is None:
        return 1
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    else:
        try:
            number = int(str(value).strip())
        except ValueError:
            raise CaseError("workers", f"must be a positive integer or 'auto', got {value!r}") from None
    if number < 1:
        raise CaseError("workers", f"must be a positive integer or 'auto', got {value!r}")
    return number


def check_run_options(args: argparse.Namespace) -> None:
    _positive(args, "budget_s", "--budget-s", "a positive number of seconds")
    _positive(args, "timeout", "--timeout", "a positive number of seconds")
    _positive(args, "limit", "--limit", "at least 1")
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:  # the field name the runner used for it (parity.run.runner.run)
        raise CaseError("threads", f"must be a positive integer, got {threads}")
    parse_workers(getattr(args, "workers", None))
    if getattr(args, "policy", None):
        try:
            load_policy(args.policy)
        except (OSError, UnicodeDecodeError) as exc:
            raise CaseError("policy", f"cannot read {args.policy}: {getattr(exc, 'strerror', None) or exc}") from None
        except (AttributeError, TypeError):
            raise CaseError("policy", f"{args.policy} is not a tolerance policy (see parity/policy.json)") from None
