"""``bench --sections ops``: the ATen-op counter, the engine's phase observer it hangs on, and the section's report.
Counts are reported by the bench, never asserted as a budget here: these tests check what is counted and where it is
attributed, each with its negative control."""

from __future__ import annotations

import copy
import json

import torch

from bench import output as bench_output
from bench.ops import HostReads, OpCounter, PhaseCounts, count_case
from cases.suites import load_suite
from cli.main import main as cli_main
from parity import engine
from reference.hadamard import rotate_activation


def test_counter_counts_kernels_and_not_views():
    x = torch.randn(4, 8)
    with OpCounter() as views:
        x.view(8, 4).transpose(0, 1).unsqueeze(0).expand(3, 4, 8)[0, :2]
    with OpCounter() as compute:
        (x + 1).exp().sum()
    assert views.total == 0                                   # no kernel runs for a view
    assert compute.ops == {"add": 1, "exp": 1, "sum": 1}


def test_counter_sees_the_backward_too():
    x = torch.randn(5, requires_grad=True)
    with OpCounter() as forward_only:
        y = (x * 2).sum()
    with OpCounter() as both:
        z = (x * 2).sum()
        z.backward()
    assert both.total > forward_only.total
    del y


def test_sites_name_the_reference_function_that_issued_the_op():
    with OpCounter(sites=True) as counted:
        rotate_activation(torch.randn(3, 16))
    assert "hadamard.py:rotate_activation" in counted.sites
    with OpCounter(sites=True) as outside:                   # control: ops issued here are nobody's in reference/
        torch.randn(3, 16) @ torch.randn(16, 16)
    assert len(outside.sites) == 1 and next(iter(outside.sites)).startswith("(other: tests/parity/test_bench_ops.py")
    x = torch.randn(3, 16, requires_grad=True)
    y = rotate_activation(x).sum()
    with OpCounter(sites=True) as backward:
        y.backward()
    ran_by_autograd = sum(n for s, n in backward.sites.items() if s.startswith("(backward of tests/parity/"))
    assert ran_by_autograd >= 2                              # the matmul's and the sum's backward kernels


def test_every_phase_of_a_case_is_counted_only_while_observed():
    case = load_suite("smoke")[0]
    options = engine.RunOptions(device="cpu", provider="torch")
    result, counts = count_case(case, options)
    assert result.outcome == "pass"
    assert set(counts.per_phase) >= {"materialize", "impl", "reference", "compare"}
    assert all(sum(ops.values()) > 0 for ops in counts.per_phase.values())
    assert sum(counts.sites["reference"].values()) == sum(counts.per_phase["reference"].values())
    assert sum(counts.sites["compare"].values()) == sum(counts.per_phase["compare"].values())
    assert any(site.startswith("metrics.py:") for site in counts.sites["compare"])
    assert not counts.sites["impl"]                           # sites only for the reference and the comparison
    assert counts.reads["compare"] > 0                        # the metrics' read-backs, each a wait on CUDA
    # control: a case run outside observing_phases reaches no observer
    seen = PhaseCounts()
    with engine.observing_phases(seen):
        pass
    from parity import impls
    engine.run_case(case, impls.load("fused"), impls.load("reference"), options)
    assert not seen.per_phase


def test_the_section_reports_ops_per_phase_and_a_valid_schema(tmp_path):
    out = tmp_path / "ops.json"
    code = cli_main(["bench", "--sections", "ops", "--harness-suite", "smoke", "--harness-limit", "2",
                     "--budget-s", "0", "--quiet", "--no-plot", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    ops = report["ops"]
    assert ops["status"] == "ok" and ops["cases"] == 2 and len(ops["rows"]) == 2
    assert ops["phases"]["reference"]["ops"] == sum(r["ops"]["reference"] for r in ops["rows"])
    assert ops["phases"]["compare"]["host_reads_per_case"] == sum(r["host_reads"]["compare"] for r in ops["rows"]) / 2
    assert ops["ops_per_case"] == sum(p["ops"] for p in ops["phases"].values()) / 2
    assert ops["sites"]["reference"]
    assert bench_output.check_schema(report) == []
    broken = copy.deepcopy(report)
    del broken["ops"]["phases"]
    assert any(p.startswith("ops") for p in bench_output.check_schema(broken))


def test_host_reads_are_counted_and_device_work_is_not():
    x = torch.randn(8)
    with HostReads() as reads:
        float(x.sum())
        x[x > 0]
        x.tolist()
    with HostReads() as none:
        (x * 2).exp().sum()                                   # control: stays where the tensor is
    assert reads.total == 3 and none.total == 0
