"""Baselines: arch naming, save / load round trip, how --baseline names resolve."""

from __future__ import annotations

import json

import pytest

from reports.baselines import arch_of, available, default_baseline, default_name, load_baseline, save_baseline
from reports.drift import GateConfig, compare_tables
from reports.errors import ReportError
from reports.load import load_run
from reports.table import metrics_table

from .conftest import rows_of, write_rows


@pytest.mark.parametrize("gpu, arch", [(None, "cpu"), ("", "cpu"), ("NVIDIA H200 (sm90)", "h200"),
                                       ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GB200", "gb200")])
def test_arch_of(gpu, arch):
    assert arch_of({"gpu": gpu}) == arch


def test_save_and_load_round_trip(runs, tmp_path):
    data = load_run(runs["base"])
    table = metrics_table(data)
    target = save_baseline(data, table, "smoke", root=tmp_path, gate=GateConfig(factor=3.0))
    assert target == tmp_path / "cpu" / "smoke"
    env = json.loads((target / "env.json").read_text())
    assert env["run_id"] == "base" and env["arch"] == "cpu" and env["counts"] == data.counts
    assert env["env"]["torch"] == data.env["torch"]
    assert available(tmp_path) == ["cpu/smoke"]
    baseline = load_baseline("cpu/smoke", root=tmp_path)
    assert baseline.gate["factor"] == 3.0
    assert compare_tables(table, baseline.table).passed
    assert (baseline.table["case_id"] == table["case_id"]).all()


def test_bare_name_resolves_under_the_runs_arch_and_auto_default(runs, tmp_path):
    data = load_run(runs["base"])
    save_baseline(data, metrics_table(data), "smoke", root=tmp_path)
    assert load_baseline("smoke", current=data, root=tmp_path).path == tmp_path / "cpu" / "smoke"
    assert default_baseline(data, tmp_path) == "cpu/smoke"
    # negative control: a GPU run does not pick up the CPU baseline
    gpu_run = load_run(runs["base"])
    gpu_run.run["env"] = {**gpu_run.env, "gpu": "NVIDIA H200 (sm90)"}
    assert default_baseline(gpu_run, tmp_path) is None
    with pytest.raises(ReportError, match=r"no baseline 'smoke' \(looked for .*h200/smoke\); available: cpu/smoke"):
        load_baseline("smoke", current=gpu_run, root=tmp_path)


def test_another_implementations_run_has_its_own_default_baseline(runs, tmp_path):
    """A run of ``--impl megatron`` is gated against ``<arch>/megatron-<suite>``, never against fused's baseline."""
    data = load_run(runs["base"])
    save_baseline(data, metrics_table(data), "smoke", root=tmp_path)
    production = load_run(runs["base"])
    production.run["impl"] = "megatron"
    assert default_name(production) == "megatron-smoke"
    assert default_baseline(production, tmp_path) is None  # fused's cpu/smoke is not production's
    save_baseline(production, metrics_table(production), default_name(production), root=tmp_path)
    assert default_baseline(production, tmp_path) == "cpu/megatron-smoke"
    assert default_baseline(data, tmp_path) == "cpu/smoke"


def test_each_production_path_has_its_own_default_baseline(runs, tmp_path):
    """``<impl>-<provider>-<suite>``, the provider as the implementation resolved it (``impl_info.provider``: auto
    -> unfused), so the unfused path is never gated against the fused path's baseline."""
    unfused = load_run(runs["base"])
    unfused.run.update(impl="megatron", provider="auto", impl_info={"provider": "unfused"})
    cudnn = load_run(runs["base"])
    cudnn.run.update(impl="megatron", provider="cudnn")
    assert default_name(unfused) == "megatron-unfused-smoke" and default_name(cudnn) == "megatron-cudnn-smoke"
    save_baseline(cudnn, metrics_table(cudnn), default_name(cudnn), root=tmp_path)
    assert default_baseline(cudnn, tmp_path) == "cpu/megatron-cudnn-smoke"
    assert default_baseline(unfused, tmp_path) is None  # negative control: not the other path's


def test_the_baseline_records_the_implementations_revision_and_stand_ins(runs, tmp_path):
    """``env.json`` keeps the run row's ``impl_info`` (Megatron's revision, provider, stand-ins) when there is one."""
    production = load_run(runs["base"])
    info = {"revision": "snapshot megatron-lm-dev-d48bd6be0a", "provider": "cudnn", "standins": ["flash_mla bridge"]}
    production.run["impl_info"] = info
    env = json.loads((save_baseline(production, metrics_table(production), "m", root=tmp_path) / "env.json").read_text())
    assert env["impl_info"] == info
    # negative control: a run row without one records none
    env = json.loads((save_baseline(load_run(runs["base"]), metrics_table(production), "f", root=tmp_path)
                      / "env.json").read_text())
    assert "impl_info" not in env


def test_a_run_directory_serves_as_baseline(runs, tmp_path):
    baseline = load_baseline(str(runs["base"]), root=tmp_path)
    assert baseline.env["run_id"] == "base" and len(baseline.table) > 0


def test_a_partial_run_is_never_baselined(tmp_path):
    data = load_run(write_rows(rows_of(n_cases=4, complete=False), tmp_path / "run"))
    with pytest.raises(ReportError, match="no 'end' row"):
        save_baseline(data, metrics_table(data), "smoke", root=tmp_path / "b")


def test_a_budget_stopped_run_is_not_baselined(tmp_path):
    """``compare --update`` of a run ``--budget-s`` stopped would make every later gate check only the cases it ran
    (found by review: it was recorded, ``complete: false`` in its env.json, and gates passed against it); a baseline
    directory recording such a run is refused too. Control: the whole run is recorded, complete."""
    rows = rows_of(n_cases=4)
    rows[-1] = {**rows[-1], "stopped": "budget", "budget_s": 10.0, "not_run": ["aaaaaaaaaaaa", "bbbbbbbbbbbb"]}
    data = load_run(write_rows(rows, tmp_path / "run"))
    assert not data.complete
    with pytest.raises(ReportError, match=r"left 2 case\(s\) unstarted.*refusing to baseline a partial run"):
        save_baseline(data, metrics_table(data), "smoke", root=tmp_path / "b")
    assert not (tmp_path / "b").exists()
    full = load_run(write_rows(rows_of(n_cases=4), tmp_path / "run2"))
    target = save_baseline(full, metrics_table(full), "full", root=tmp_path / "b")
    env = json.loads((target / "env.json").read_text())
    assert env["complete"] is True and "not_run" not in env
    assert load_baseline(str(target)).env["complete"] is True
    (target / "env.json").write_text(json.dumps({**env, "complete": False, "not_run": 2}))
    with pytest.raises(ReportError, match="records a partial run"):
        load_baseline(str(target))


def test_a_run_with_a_case_cut_off_is_not_baselined(tmp_path):
    from .test_coverage_gate import engine_order

    rows = engine_order(rows_of(n_cases=4))
    victim = next(r["case_id"] for r in rows if r["type"] == "case" and r.get("n_rows"))
    data = load_run(write_rows([r for r in rows if not (r["type"] == "metric" and r["case_id"] == victim)],
                               tmp_path / "run"))
    assert data.cut == [victim]
    with pytest.raises(ReportError, match=r"1 case\(s\) cut off.*refusing to baseline a partial run"):
        save_baseline(data, metrics_table(data), "smoke", root=tmp_path / "b")


@pytest.mark.parametrize("name", ["../evil", "a/b/c", "sp ace"])
def test_baseline_names_are_checked(runs, tmp_path, name):
    data = load_run(runs["base"])
    with pytest.raises(ReportError, match="baseline names"):
        save_baseline(data, metrics_table(data), name, root=tmp_path)


def test_a_broken_gate_json_names_the_file(runs, tmp_path):
    data = load_run(runs["base"])
    target = save_baseline(data, metrics_table(data), "smoke", root=tmp_path)
    (target / "gate.json").write_text('{"factor": 0.5}')
    from reports.render import gate_for
    with pytest.raises(ReportError, match=r"gate.json.factor: must be a number > 1"):
        gate_for(load_baseline("cpu/smoke", root=tmp_path))


def test_a_gpu_runs_case_peaks_are_kept_beside_its_baseline_and_read_back(tmp_path):
    """``memory.csv``: each case's largest phase peak, which later runs of the path read for memory admission."""
    from reports.baselines import PEAKS_NAME, measured_peaks

    rows = rows_of(n_cases=4, run_id="gpu")
    cases = [r for r in rows if r.get("type") == "case"]
    for i, row in enumerate(cases):
        row["peak_gpu_bytes"] = {"impl": (i + 1) << 30, "reference": (i + 2) << 30 if i == 1 else 1 << 29}
    cases[3]["outcome"] = "error"  # an error's phases record what they held before they stopped: left out
    data = load_run(write_rows(rows, tmp_path / "gpu"))
    data.run["env"] = {**data.env, "gpu": "NVIDIA H200"}
    target = save_baseline(data, metrics_table(data), "gate", root=tmp_path / "b")
    assert target == tmp_path / "b" / "h200" / "gate"
    peaks = measured_peaks("h200", "gate", root=tmp_path / "b")
    assert peaks == {cases[0]["case_id"]: 1 << 30, cases[1]["case_id"]: 3 << 30, cases[2]["case_id"]: 3 << 30}

    # what the allocator held from the GPU, where the rows have it, is the peak read back (its allocations stay
    # in the file beside it); a case without it keeps its allocated peak
    cases[1]["peak_gpu_reserved_bytes"] = {"impl": 2 << 30, "reference": 5 << 30}
    reserved = load_run(write_rows(rows, tmp_path / "gpu-reserved"))
    reserved.run["env"] = {**reserved.env, "gpu": "NVIDIA H200"}
    save_baseline(reserved, metrics_table(reserved), "gate-r", root=tmp_path / "b")
    table = (tmp_path / "b" / "h200" / "gate-r" / PEAKS_NAME).read_text().splitlines()
    assert table[0] == "case_id,peak_gpu_bytes,peak_gpu_reserved_bytes"
    assert f"{cases[1]['case_id']},{3 << 30},{5 << 30}" in table
    assert measured_peaks("h200", "gate-r", root=tmp_path / "b") == {**peaks, cases[1]["case_id"]: 5 << 30}
    assert measured_peaks("a100", "gate", root=tmp_path / "b") == {}  # another GPU's: none
    assert measured_peaks("h100", "gate", root=tmp_path / "b") == peaks  # the same sm90 kernels: the H200's stand in
    (tmp_path / "b" / "h100" / "gate").mkdir(parents=True)
    (tmp_path / "b" / "h100" / "gate" / PEAKS_NAME).write_text(f"case_id,peak_gpu_bytes\n{cases[0]['case_id']},7\n")
    assert measured_peaks("h100", "gate", root=tmp_path / "b") == {cases[0]["case_id"]: 7}  # its own win

    # negative control: retaken from a run without GPU peaks, the old file goes (it described another run)
    plain = load_run(write_rows(rows_of(n_cases=3, run_id="cpu"), tmp_path / "cpu"))
    plain.run["env"] = {**plain.env, "gpu": "NVIDIA H200"}
    save_baseline(plain, metrics_table(plain), "gate", root=tmp_path / "b")
    assert not (target / PEAKS_NAME).exists()


def test_a_baseline_name_is_never_a_directory_of_the_working_directory(runs, tmp_path, monkeypatch):
    """``cpu/smoke`` names the committed baseline under the root, even where a run directory ``cpu/smoke`` sits in
    the working directory (a stray run, or one a pull request adds where ``make parity`` runs): found by review, a
    two-case run there passed a 51-case gate. A path must say it is one (``./cpu/smoke``)."""
    data = load_run(runs["base"])
    save_baseline(data, metrics_table(data), "cpu/smoke", root=tmp_path / "root")
    work = tmp_path / "work"
    stray = work / "cpu" / "smoke"
    stray.mkdir(parents=True)
    stray.joinpath("results.jsonl").write_text("\n".join(json.dumps(r) for r in rows_of(n_cases=2, run_id="stray"))
                                               + "\n")
    monkeypatch.chdir(work)
    assert load_baseline("cpu/smoke", root=tmp_path / "root").path == tmp_path / "root" / "cpu" / "smoke"
    assert load_baseline("smoke", current=data, root=tmp_path / "root").path == tmp_path / "root" / "cpu" / "smoke"
    # control: named as a path, the run in the working directory is the baseline
    assert load_baseline("./cpu/smoke", root=tmp_path / "root").env["run_id"] == "stray"
    # a name missing under the root says how to use the local directory instead
    with pytest.raises(ReportError, match=r"no baseline 'cpu/smoke'.*name it as a path \(\./cpu/smoke\)"):
        load_baseline("cpu/smoke", root=tmp_path / "empty")


@pytest.mark.parametrize("cut", ["no end row", "budget stop"])
def test_a_partial_run_cannot_be_a_baseline(tmp_path, cut):
    """A run without its ``end`` row, or one ``--budget-s`` stopped, would gate only the work it did (a run compared
    with it could skip the rest): refused, as ``--update`` refuses to record one. Control: the whole run loads."""
    rows = rows_of(n_cases=6, run_id="whole")
    whole = write_rows(rows, tmp_path / "whole")
    assert load_baseline(str(whole)).env["run_id"] == "whole"
    if cut == "no end row":
        rows = [r for r in rows if r["type"] != "end"]
    else:
        rows = [{**r, "not_run": ["0123456789ab"]} if r["type"] == "end" else r for r in rows]
    partial = write_rows(rows, tmp_path / "partial")
    with pytest.raises(ReportError, match="a partial run cannot be a baseline"):
        load_baseline(str(partial))


def test_a_run_with_a_case_cut_off_cannot_be_a_baseline_through_its_rendered_results_csv(tmp_path):
    """A run directory whose ``results.csv`` is newer than its stream is read from the CSV (faster); the check for
    cases cut off mid-write used to look only at the stream's end row there, so a run that lost a case's metric rows
    became a baseline through its CSV (found by review). Control: the whole run, CSV and all, loads."""
    from reports.table import write_csv

    from .test_coverage_gate import engine_order

    rows = engine_order(rows_of(n_cases=6, run_id="csv"))
    victim = next(r["case_id"] for r in rows if r["type"] == "case" and r.get("n_rows"))
    whole = write_rows(rows, tmp_path / "whole")
    write_csv(metrics_table(load_run(whole)), whole / "results.csv")
    assert load_baseline(str(whole)).env["run_id"] == "csv"
    cut = write_rows([r for r in rows if not (r["type"] == "metric" and r["case_id"] == victim)], tmp_path / "cut")
    write_csv(metrics_table(load_run(cut)), cut / "results.csv")
    with pytest.raises(ReportError, match=rf"has 1 case\(s\) cut off \(e.g. {victim}\)"):
        load_baseline(str(cut))
