"""``dsv4-parity bench --impl``: every named implementation is measured in e2e on its provider, its kernels timed
through its own ``observe_kernels`` hook (reached through :mod:`parity.impls`). Production (``--impl megatron``) runs
on the CPU with the ``emulated`` provider (its fused path over the torch stand-ins). Nothing here asserts a speed."""

from __future__ import annotations

import contextlib
import json
import time

import pytest

from bench import core as bench, impls as bench_impls, measure as bench_measure, output as bench_output
from bench.side_by_side import markdown, side_by_side
from cli.main import main as cli_main

TINY = ["bench", "--sections", "e2e", "--profile", "tiny", "--tokens", "256", "--repeats", "1", "--warmup", "0",
        "--device", "cpu", "--budget-s", "0", "--no-plot", "--quiet"]


def _run(tmp_path_factory, name: str, extra: list) -> dict:
    out = tmp_path_factory.mktemp(name) / "bench.json"
    assert cli_main(TINY + extra + ["--json", str(out)]) == 0
    return {"report": json.loads(out.read_text()), "markdown": out.with_suffix(".md").read_text()}


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return _run(tmp_path_factory, "emulated", ["--impl", "fused,megatron", "--provider", "emulated",
                                               "--scope", "core,layer", "--no-reference"])


@pytest.fixture(scope="module")
def unfused(tmp_path_factory):
    return _run(tmp_path_factory, "unfused", ["--impl", "megatron", "--provider", "unfused", "--scope", "core"])


def _rows(report, impl):
    return [r for r in report["e2e"] if r["impl"] == impl]


def test_megatron_emulated_rows_time_production_kernels(emulated):
    report = emulated["report"]
    assert bench_output.check_schema(report) == []
    rows = _rows(report, "megatron")
    assert [(r["scope"], r["status"], r["provider"]) for r in rows] == [("core", "ok", "emulated"),
                                                                       ("layer", "ok", "emulated")]
    for r in rows:
        assert r["kernel_sum_ms"] > 0 and r["composition_ratio"] > 0 and "kernels_note" not in r
        stages = {k["stage"] for k in r["kernels"]}
        assert stages >= {"indexer_forward", "indexer_top_k", "sparse_attn_fwd", "sparse_attn_bwd"}, stages
        assert set(r["plan"].values()) == {"torch"}  # the emulated provider's kernels are the torch stand-ins
    assert report["impls"]["megatron"]["observe_kernels"] is True
    assert report["impls"]["megatron"]["provider"] == "emulated"
    assert report["settings"]["impls"] == ["fused", "megatron"] and not _rows(report, "reference")


def test_an_unsupported_combination_is_a_row_not_a_crash(emulated):
    """fused has no ``emulated`` provider: its rows say so, and production's rows beside them are measured."""
    fused = _rows(emulated["report"], "fused")
    assert fused and all(r["status"] == "unsupported" and "no provider 'emulated'" in r["message"] for r in fused)


def test_side_by_side_puts_production_next_to_fused(emulated):
    rows = emulated["report"]["side_by_side"]
    assert [(r["scope"], sorted(r["impls"])) for r in rows] == [("core", ["fused", "megatron"]),
                                                               ("layer", ["fused", "megatron"])]
    cell = rows[0]["impls"]["megatron"]
    assert cell["status"] == "ok" and cell["kernel_sum_ms"] > 0 and cell["time_ms"] > 0
    assert rows[0]["vs_first"] == {}  # fused did not run: no ratio to it (negative control of vs_first)
    text = emulated["markdown"]
    assert "| megatron fwd+bwd ms | megatron kernels ms | megatron ratio |" in text
    assert "fused: unsupported: fused has no provider 'emulated'" in text


def test_unfused_provider_observes_no_kernel_and_says_why(unfused):
    """Negative control: production's PyTorch path makes no kernel call, so there is no kernel sum."""
    report = unfused["report"]
    assert bench_output.check_schema(report) == []
    (row,) = _rows(report, "megatron")
    assert row["status"] == "ok" and row["provider"] == "unfused"
    assert row.get("kernel_sum_ms") is None and not row.get("kernels") and not row.get("composition_ratio")
    assert "no kernels observed" in row["kernels_note"] and "unfused" in row["kernels_note"]
    assert [r["status"] for r in _rows(report, "reference")] == ["ok"]  # the reference still runs beside it
    assert "| 256 | seq | core | " in unfused["markdown"] and "| none |" in unfused["markdown"]


@pytest.mark.parametrize("value, says", [("nosuch", "nosuch"), ("fused,reference", "reference"), (",", "at least")])
def test_bad_impl_is_one_line_naming_the_field(value, says, capsys):
    assert cli_main(["bench", "--impl", value, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: impl") and says in err and "\n" not in err, err


# ---- provider mapping, on stand-in implementations ----------------------------------------------------------------------
class _FakeApi:
    """An implementation with providers (``unfused`` default, ``cudnn`` usable or not) and optionally a kernel hook."""

    def __init__(self, cudnn_why=None, hook=True, own_auto="unfused"):
        self._why, self._own = cudnn_why, own_auto
        if hook:
            self.observe_kernels = lambda observer: contextlib.nullcontext()

    def use_backend(self, provider="auto", require=()):
        return contextlib.nullcontext()

    def available_providers(self):
        return {"unfused": None, "emulated": None, "cudnn": self._why}

    def provider_name(self, provider):
        return self._own if provider in ("auto", "torch") else provider


def _impl(**kw):
    from parity.impls import Implementation

    return Implementation("fake", _FakeApi(**kw))


def test_auto_picks_observable_cudnn_where_it_runs_else_the_own_default():
    assert bench_impls.bench_provider(_impl(), "auto") == ("cudnn", None)
    assert bench_impls.bench_provider(_impl(cudnn_why="no GPU"), "auto") == ("unfused", None)
    assert bench_impls.bench_provider(_impl(hook=False), "auto") == ("unfused", None)  # kernels not observable
    assert bench_impls.bench_provider(_impl(own_auto="auto"), "auto") == ("auto", None)  # picks per stage (fused)
    provider, why = bench_impls.bench_provider(_impl(cudnn_why="no GPU"), "cudnn")
    assert provider == "cudnn" and "unavailable here: no GPU" in why
    provider, why = bench_impls.bench_provider(_impl(), "flashmla")
    assert "has no provider 'flashmla'" in why
    assert bench_impls.bench_provider(_impl(), "emulated") == ("emulated", None)


def test_fused_and_reference_keep_their_providers():
    from parity.impls import load

    assert bench_impls.bench_provider(load("fused"), "auto") == ("auto", None)
    assert bench_impls.bench_provider(load("fused"), "torch") == ("torch", None)
    assert bench_impls.bench_provider(load("reference"), "cudnn") == ("none", None)
    assert bench_impls.bench_impl("reference", "auto").observe_kernels is None


def test_kernel_recorder_attaches_to_the_hook_it_is_given():
    from fused import plan as plan_mod

    opened = []

    @contextlib.contextmanager
    def hook(observer):
        opened.append(observer)
        yield

    with bench_measure.KernelRecorder("cpu", observe=hook) as rec:
        with rec.observe("sparse_attn_fwd", "torch"):
            pass
        rec.flush()
        assert plan_mod._OBSERVERS == []  # not fused's dispatcher (negative control)
    assert opened == [rec.observe] and rec.stats[("sparse_attn_fwd", "torch")].calls == 1


def test_a_budget_cut_leaves_skipped_rows_of_every_impl():
    parser_args = _parsed(TINY + ["--impl", "megatron", "--provider", "emulated"])
    settings = bench.resolve_settings(parser_args)
    b = bench.Bench(settings, bench.empty_report(settings, []), lambda _m: None)
    row = b.e2e(b.workload("tiny", 256, scope="core"), "megatron", time.monotonic() - 1)
    assert row["status"] == "skipped" and row["message"] == "time budget"


def test_side_by_side_ratio_against_the_first_impl():
    def row(impl, ms, status="ok"):
        return {"profile": "kernel", "tokens": 4096, "layout": "seq", "segment_len": None, "ratio": 4,
                "loss": "sparse", "dtype": "bfloat16", "scope": "layer", "impl": impl, "provider": "cudnn",
                "status": status, "message": "", "time": {"median_ms": ms}, "kernel_sum_ms": ms and ms / 2,
                "composition_ratio": ms and 2.0}

    rows = side_by_side([row("fused", 10.0), row("megatron", 15.0), row("reference", 900.0)], ["fused", "megatron"])
    assert len(rows) == 1 and sorted(rows[0]["impls"]) == ["fused", "megatron"]
    assert rows[0]["vs_first"] == {"fused": 1.0, "megatron": 1.5}
    text = markdown(rows, ["fused", "megatron"])
    assert "| kernel | 4096 | seq | layer | 10 | 5 | 2.00 | 15 | 7.5 | 2.00 | 1.50 |" in text
    cut = side_by_side([row("fused", 10.0), row("megatron", None, "skipped")], ["fused", "megatron"])
    assert cut[0]["vs_first"] == {"fused": 1.0}  # negative control: a skipped row has no ratio


def _parsed(argv):
    from cli.main import build_parser

    return build_parser().parse_args(argv)


def test_provider_per_implementation():
    impls = ["fused", "megatron"]
    assert bench_impls.parse_providers("fused=torch,megatron=emulated", impls) == {"fused": "torch",
                                                                                  "megatron": "emulated"}
    assert bench_impls.parse_providers("megatron=emulated", ["megatron"]) == {"megatron": "emulated", "fused": "auto"}
    assert bench_impls.parse_providers("cudnn", impls) == {"fused": "cudnn", "megatron": "cudnn"}
    assert bench_impls.parse_providers("emulated", ["megatron"]) == {"megatron": "emulated", "fused": "auto"}
    assert bench_impls.parse_providers("emulated", impls) == {"fused": "emulated", "megatron": "emulated"}
    for bad, says in (("bogus", "'bogus' is a provider of none"), ("fused=emulated", "fused has no provider"),
                      ("reference=torch", "an --impl name"), ("torch,cudnn", "one name")):
        with pytest.raises(bench.CaseError, match="provider") as err:
            bench_impls.parse_providers(bad, impls)
        assert says in str(err.value), err.value


def test_cli_runs_each_implementation_on_its_own_provider(tmp_path):
    out = tmp_path / "b.json"
    argv = TINY + ["--impl", "fused,megatron", "--provider", "fused=torch,megatron=emulated", "--scope", "core",
                   "--no-reference", "--sections", "e2e,stages", "--json", str(out)]
    assert cli_main(argv) == 0
    report = json.loads(out.read_text())
    assert bench_output.check_schema(report) == []
    rows = {r["impl"]: r for r in report["e2e"]}
    assert (rows["fused"]["provider"], rows["megatron"]["provider"]) == ("torch", "emulated")
    assert all(r["status"] == "ok" and r["kernel_sum_ms"] > 0 for r in rows.values())
    assert set(report["side_by_side"][0]["vs_first"]) == {"fused", "megatron"}
    # stages: production's kernels per group beside fused's (the compressor is an eager stage function: fused only)
    stages = {r["group"]: r["impls"]["megatron"] for r in report["stages"]}
    assert stages["compressor"]["status"] == "absent"
    for group in ("indexer forward", "top-k", "sparse attention fwd", "sparse attention bwd"):
        assert stages[group]["status"] == "ok" and stages[group]["time_ms"] > 0, (group, stages[group])


def test_a_stage_group_without_kernel_calls_is_absent_and_says_why():
    ok = {"status": "ok", "message": "", "kernels": [{"stage": "sparse_attn_fwd", "provider": "torch", "calls": 1,
                                                      "time_ms": 2.0, "peak_mem_bytes": 10}]}
    group = bench.Bench._kernel_group(ok, ("sparse_attn_fwd",), {"sparse_attn_fwd": 2e9})
    assert group["status"] == "ok" and group["time_ms"] == 2.0 and group["tflops"] == pytest.approx(1.0)
    none = dict(ok, kernels=[], kernels_note="no kernels observed: megatron on provider 'unfused' ...")
    group = bench.Bench._kernel_group(none, ("sparse_attn_fwd",), {})
    assert group["status"] == "absent" and "no kernels observed" in group["message"]
    failed = dict(ok, status="unsupported", message="no GPU")
    assert bench.Bench._kernel_group(failed, ("sparse_attn_fwd",), {})["status"] == "unsupported"


def test_unknown_provider_is_one_line_naming_the_field(capsys):
    assert cli_main(["bench", "--provider", "bogus", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: provider") and "bogus" in err and "\n" not in err, err
