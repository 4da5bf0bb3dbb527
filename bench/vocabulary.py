"""The bench's names the command line offers before it loads torch (standard library only): the sections, the
layouts and the losses of the benchmarked layer. :mod:`bench.core` and :mod:`bench.workloads` use these."""

from __future__ import annotations

#: sections run by default, in order
SECTIONS = ("e2e", "stages", "breakdown", "scaling", "harness", "startup")
#: sections run only when named: the whole gate suite, cold and warm (bench/gate.py); the ATen ops each engine phase
#: dispatches per case (bench/ops.py)
OPT_IN_SECTIONS = ("gate", "ops")
#: seq: one sequence of T tokens (BSHD); pack: a THD pack of fixed-length segments
LAYOUTS = ("seq", "pack")
#: the indexer loss of the benchmarked layer
LOSSES = ("sparse", "dense", "none")
