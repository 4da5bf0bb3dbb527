"""Project-wide pytest configuration (root conftest: the repository root is importable, torch is deterministic)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

# Under pytest-xdist every worker is a process of its own: one intra-op thread each keeps 2 workers from
# oversubscribing 2 cores (measured: a tiny reference forward takes 3 ms with 1 thread, 58 ms with 2 contended).
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))
torch.use_deterministic_algorithms(True, warn_only=True)


def pytest_addoption(parser):
    """Parity options (tests/parity/test_suite_cases.py runs every case of ``--suite`` as one test)."""
    group = parser.getgroup("dsv4-parity")
    group.addoption("--suite", default="smoke", help="suite whose cases tests/parity/test_suite_cases.py runs "
                                                     "(smoke, gate, nightly, production; default smoke)")
    group.addoption("--parity-impl", default="fused", help="implementation under test (default fused)")
    group.addoption("--parity-against", default="reference", help="the truth implementation (default reference)")
    group.addoption("--parity-provider", default="auto", help="fused kernel provider (default auto)")
