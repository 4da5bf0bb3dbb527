"""dsv4-parity: the parity engine — run two implementations on a case, diff every tensor, decide, stream JSONL.

One module per job:

==================  ===================================================================================================
``snapshot``        run one implementation forward + backward on a case's tensors; the compared tensors by name
``metrics``         per-tensor error metrics in float64 (max abs / rel, RMSE, rel L2, cosine, tensor-sim, noise-floor
                    ratio, scale error, ...)
``structure``       rule 1: exact structural checks (presence, shape, dtype, finiteness, padding, top-k conventions)
``topk``            the tie-margin-aware top-k comparison
``verdict``         the layered verdict per tensor and per case
``location``        where a failing tensor is worst (index; THD segment, position, head) for the messages
``policy``          the tolerance policy (``policy.json``)
``engine``          one case: implementation, float64 truth and same-dtype noise run (split mode), then the verdict
``metamorphic``     single-implementation oracles (THD pack, padding poison, capacity, identical segments, ...)
``results``         the ``results.jsonl`` rows, streaming writer and resume
``execution``       one request (case, options, oracle) run in this process: what the runner and the worker call
``runner``          a whole run: selection, isolation, progress, summary, exit code
``worker``          the isolated child process (one sticky CUDA fault costs one case)
``junit``           JUnit XML from the results
``environment``     versions / GPU / git revision of a run
``calibrate``       the measured worst cases behind the policy
``impls``           implementations by name (``reference``, ``fused``, ``module:attr``)
``mutation_suite``  the mutation suite (planted bugs must fail the parity suite)
==================  ===================================================================================================

Library use::

    from parity import impls
    from parity.engine import RunOptions, run_case
    result = run_case(case, impls.load("fused"), impls.load("reference"), RunOptions())
    result.outcome, result.decided_by, result.first_failure, result.rows()
"""
