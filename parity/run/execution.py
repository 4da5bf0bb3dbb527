"""One request run in this process: what :func:`parity.run.runner.run` does in-process and the worker child
(:mod:`parity.run.worker`) does per line, so neither of the two imports the other for it.

A request is ``{"case": {...}, "options": {...}, "oracle": null | name}``; the answer is the case's result rows.
"""

from __future__ import annotations

import functools

from cases.case import Case

from parity.engine import RunOptions, one_line, run_case
from parity.impls import Implementation, load
from parity.oracles.metamorphic import run_oracle
from parity.run import results


@functools.lru_cache(maxsize=None)
def load_impl(name: str) -> Implementation:
    """:func:`parity.impls.load`, once per process and name."""
    return load(name)


def execute(request: dict) -> list[dict]:
    """Run one request ``{"case", "options", "oracle"}`` in this process; returns its result rows."""
    case = Case.from_dict(request["case"])
    options = RunOptions(**request["options"])
    oracle = request.get("oracle")
    try:
        impl = load_impl(options.impl)
        with impl.parallel(options.cp):  # --cp N: the implementation's context-parallel ranks
            if oracle:
                result = run_oracle(oracle, case, impl, options)
            else:
                result = run_case(case, impl, load_impl(options.against), options)
    except Exception as exc:  # noqa: BLE001 — e.g. an implementation that cannot even be imported
        return error_rows(case, options, one_line(exc))
    return result.rows()


def error_rows(case: Case, options: RunOptions, message: str) -> list[dict]:
    """The rows of a case that ended in ``error`` with ``message`` before or outside the engine."""
    return results.CaseResult(case=case, outcome="error", decided_by="error", message=message,
                              repro=options.repro(case),
                              first_failure={"tensor": None, "rule": "error", "message": message}).rows()
