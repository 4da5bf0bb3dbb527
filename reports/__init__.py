"""dsv4-parity reports: every view of a run, rendered from its ``results.jsonl`` only (schema: ARCHITECTURE.md).

Modules, in data-flow order:

* :mod:`reports.load`      — parse the stream (live or cut streams included) into case / tensor / metric frames.
* :mod:`reports.table`     — the per-case per-tensor metrics table = ``results.csv`` (schema: ``reports/SCHEMA.md``).
* :mod:`reports.summary`   — per class / per case aggregates, worst offenders, top-k regimes, providers.
* :mod:`reports.drift`     — drift against a baseline and the relative-regression gate.
* :mod:`reports.baselines` — committed baselines ``reports/baselines/<arch>/<name>/``.
* :mod:`reports.coverage`, :mod:`reports.mutants` — coverage matrix, mutation kill matrix.
* :mod:`reports.terminal`, :mod:`reports.plots`, :mod:`reports.html` (+ ``templates/``) — the three views.
* :mod:`reports.render`    — all views of one run directory (the ``report`` / ``compare`` commands are in ``cli/``).

Never imports ``reference``, ``fused`` or ``parity``.
"""
