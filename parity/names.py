"""The engine's names the command line parses, checks and prints before it loads torch (this module imports only
the standard library): where runs are written, the metamorphic oracles, the mutation suites' files.

Each is defined here once; :mod:`parity.run.runner`, :mod:`parity.oracles.metamorphic`, :mod:`parity.mutation.mutation_suite` and
:mod:`parity.mutation.megatron_mutants` use these (tests check that they agree).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: run directories default to ``OUT_ROOT/<run-id>``; ``OUT_ROOT/latest`` names the newest ``make parity`` run
OUT_ROOT = REPO / "reports" / "out"

#: metamorphic oracle -> one-line summary (``dsv4-parity metamorphic --list``), in the order they run
ORACLE_SUMMARIES = {
    "thd-pack": "THD pack = its real segments run one by one as BSHD B=1",
    "padding-poison": "poisoned padding rows change nothing on real rows (bitwise)",
    "padding-dout": "a huge output gradient on padding rows changes nothing (bitwise)",
    "unpadded": "a padded pack (poisoned) equals the same segments packed without padding",
    "capacity": "a compressed-row capacity equals the exact count",
    "identical-segments": "segments with equal leading rows give equal rows",
    "determinism": "two runs are bit-identical (padding rows included)",
    "cp": "with N context-parallel ranks (--cp N, default 2) equals CP = 1 within the noise floor (THD)",
    "graph-replay": "a CUDA graph replayed on other packings equals eager (CUDA only)",
}

#: the kill matrix of a mutation run, next to its clean run's results.jsonl
MUTANTS_NAME = "mutants.jsonl"
#: ``mutants`` without ``--out``: a link naming the newest mutation run (each run writes a new sibling folder)
MUTANTS_LINK = Path("reports") / "out" / "mutants"
#: where ``mutants --impl megatron`` writes without ``--out`` (not the fused suite's folder)
MEGATRON_MUTANTS_OUT = Path("reports") / "out" / "mutants-megatron"
