"""``dsv4-parity``: the command line. It sits on top of the project and imports it statically: :mod:`cases` (the
data model and suites), :mod:`parity` (the engine), :mod:`reports` (the views and the drift gate) and :mod:`bench`
(speed and memory). Nothing below imports it.

==========================  =========================================================================================
``main``                    the parser; ``run``, ``metamorphic``, ``calibrate``
``options``                 options shared by the subcommands; case selection (``--suite`` / ``--case`` / ...)
``cases_command``           ``cases``, ``shrink``
``report_command``          ``report``, ``compare`` (the drift gate)
``mutants_command``         ``mutants``
``bench_command``           ``bench``
``compare_runs_command``    ``compare-runs``
==========================  =========================================================================================
"""
