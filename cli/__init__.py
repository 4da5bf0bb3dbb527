"""``dsv4-parity``: the command line. It sits on top of the project: :mod:`cases` (the data model and suites),
:mod:`parity` (the engine), :mod:`reports` (the views and the drift gate) and :mod:`bench` (speed and memory). The
parser imports only their torch-free names (``cases.vocabulary``, ``parity.names``, ``bench.vocabulary``,
``reports.schema``); a command imports what its work needs when it runs. Nothing below imports it.

==========================  =========================================================================================
``main``                    the parser and the dispatch (torch loads only for a command that needs it)
``run_command``             ``run``, ``metamorphic``, ``calibrate`` (imported when one of them runs)
``options``                 options shared by the subcommands; case selection (``--suite`` / ``--case`` / ...)
``cases_command``           ``cases``, ``shrink``
``report_command``          ``report``, ``compare`` (the drift gate)
``mutants_command``         ``mutants``
``bench_command``           ``bench``
``compare_runs_command``    ``compare-runs``
``cache_command``           ``cache`` (without torch)
==========================  =========================================================================================
"""
