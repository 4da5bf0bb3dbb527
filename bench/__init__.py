"""``dsv4-parity bench``: speed and memory of the fused path, the reference and the harness — reported, never
asserted. :mod:`bench.core` has the sections and targets; the command line is :mod:`cli.bench_command`."""
