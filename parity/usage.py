"""Usage checks of a run's options, made before any case runs (each a :class:`CaseError` naming the option).

* ``--budget-s`` and ``--timeout`` must be positive (``--budget-s 0`` would start nothing, ``--timeout 0`` kill
  every case), ``--limit`` at least 1 (a green run of 0 cases proves nothing);
* ``--policy`` must be a readable, valid tolerance policy (otherwise every case would end in the same error).
"""

from __future__ import annotations

import argparse

from cases.errors import CaseError


def _positive(args: argparse.Namespace, dest: str, option: str, what: str) -> None:
    value = getattr(args, dest, None)
    if value is not None and not value > 0:
        raise CaseError(option, f"must be {what}, got {value:g}")


def check_run_options(args: argparse.Namespace) -> None:
    _positive(args, "budget_s", "--budget-s", "a positive number of seconds")
    _positive(args, "timeout", "--timeout", "a positive number of seconds")
    _positive(args, "limit", "--limit", "at least 1")
    if getattr(args, "policy", None):
        from .policy import load

        try:
            load(args.policy)
        except (OSError, UnicodeDecodeError) as exc:
            raise CaseError("policy", f"cannot read {args.policy}: {getattr(exc, 'strerror', None) or exc}") from None
        except (AttributeError, TypeError):
            raise CaseError("policy", f"{args.policy} is not a tolerance policy (see parity/policy.json)") from None
