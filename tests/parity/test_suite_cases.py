"""Every case of a suite as one pytest test: ``pytest tests/parity/test_suite_cases.py --suite smoke -n auto``.

Options (root conftest.py): ``--suite`` (default smoke), ``--parity-impl`` (fused), ``--parity-against``
(reference), ``--parity-provider`` (auto). A case the implementation declines (or that needs a GPU) is skipped;
a failing case reports its first failure and its repro command.
"""

import pytest

from parity import impls
from parity.engine import RunOptions, run_case


def pytest_generate_tests(metafunc):
    if "suite_case" in metafunc.fixturenames:
        from cases.suites import load_suite

        cases = load_suite(metafunc.config.getoption("--suite"))
        metafunc.parametrize("suite_case", cases, ids=[c.id for c in cases])


@pytest.fixture(scope="module")
def options(request):
    cfg = request.config
    return RunOptions(impl=cfg.getoption("--parity-impl"), against=cfg.getoption("--parity-against"),
                      provider=cfg.getoption("--parity-provider"))


def test_case(suite_case, options):
    result = run_case(suite_case, impls.load(options.impl), impls.load(options.against), options)
    if result.outcome == "unsupported":
        pytest.skip(result.message)
    assert result.outcome == "pass", \
        f"{result.outcome} ({result.decided_by}): {result.message}\nrepro: {result.repro}"
