"""dsv4-parity: the parity engine — run two implementations on a case, diff every tensor, decide, stream JSONL.

The engine on the ground floor, its parts one floor each (no floor imports the CLI, the reports or the bench; no
import cycle, ``tests/parity/test_imports.py``):

================  =====================================================================================================
``engine``        one case: the implementation, the float64 truth and same-dtype noise runs (split mode), the verdict,
                  then the known-deviation registry
``impls``         implementations by name (``reference``, ``fused``, ``megatron``, ``module:attr``) and their hooks
``policy``        the tolerance policy (``policy.json``, the one file of tolerances)
``names``         the names the command line lists without loading torch (oracles, output folders)
``run/``          running a suite: ``runner`` (selection, isolation, progress, exit code), ``worker`` / ``shard``
                  (child processes, GPUs), ``execution`` (one request), ``results`` / ``stream`` / ``resume`` /
                  ``rundir`` (the stream: writing it, reading it without torch, continuing it; the folder),
                  ``progress``, ``environment``, ``junit``, ``memory``, ``usage``
``judge/``        judging tensors: ``snapshot`` (one run forward + backward, tensors by name), ``metrics``,
                  ``structure`` (rule 1), ``verdict`` (the layered rules), ``topk`` (tie margins), ``sign_split``,
                  ``padding_dout`` (the padding-row contract), ``api_check`` (public compressor / indexer),
                  ``location``, ``kernel_rules``
``deviations/``   known deviations of an implementation: ``known`` (the registry: matching, revisions, outcomes) and
                  ``known_models`` (each entry's executable model of what the implementation computes instead)
``oracles/``      single-implementation metamorphic oracles (``metamorphic``: THD pack, padding, capacity, CP, ...;
                  ``graph_replay``)
``mutation/``     planted bugs the suite must catch: ``mutants`` / ``mutation_suite`` (the composition's),
                  ``megatron_mutants`` (production's real code, patched in scratch copies)
``history/``      production across its history: ``git_tree`` (throwaway worktrees, first-parent chains) and
                  ``bisect`` (the first revision whose verdict changes)
(ground floor)    ``backward_origin`` (who built a failing backward node), ``compare_runs``, ``kernel_checks`` (the
                  GPU kernels vs the torch provider), ``calibrate``, ``seed_sweep``
================  =====================================================================================================

Library use::

    from parity import impls
    from parity.engine import RunOptions, run_case
    result = run_case(case, impls.load("fused"), impls.load("reference"), RunOptions())
    result.outcome, result.decided_by, result.first_failure, result.rows()
"""
