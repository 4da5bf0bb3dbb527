"""The real-code mutants' GPU plan (``dsv4-parity mutants --impl megatron --provider cudnn``): its catalogue is
checkable without a GPU (every gate case it names is small: in ``gate-cpu``, or where no case of it kills the
mutant, at most 160 rows, but for the one mutant whose smallest clean case is larger), its verdicts follow the kill rule (a no-op
patch survives; a mutant declared unreachable must be refused on the clean tree), and its CPU preview (the
``emulated`` provider declaring the H200's capability) kills a seed mutant on the cases the GPU runs."""

from __future__ import annotations

import argparse
import json

import pytest

from cases.suites import load_suite
from parity.mutation import megatron_mutants as mm

from .test_megatron import needs_megatron

SEEDS = ("thd_dense_bwd_no_max_seqlen", "fake_bshd_view_over_batch", "invalid_comp_rows_by_count")
#: mutants no gate-cpu case can kill at sm90: the ones reaching their code (capacity-padded compressed rows; a real
#: segment after a padded one) are not clean there — 6f068643940f and 62e39d92857d fail production's padding-row
#: contract (padding_dout) on the clean tree, ff44cb580cf3 is a registered ``known`` — so their gate case is larger
BEYOND_GATE_CPU = {"invalid_comp_rows_by_count", "compressor_real_offsets"}
#: the one mutant whose gate case exceeds 160 rows: the smaller gate cases with a real segment (>= r tokens) after a
#: padded one are not clean (see parity/mutation/megatron_mutants.py); 7804f8058ac3 (1,124 rows) kills it in the sm90 preview
#: (emulated, capability 9.0: clean pass, mutant grad/hidden on padding rows + 21 more tensors; 560 s on 2 cores)
LARGER_GATE_CASE = {"compressor_real_offsets": 1124}


def _mutant(name):
    return next(m for m in mm.MUTANTS if m.name == name)


# ---- the catalogue ----------------------------------------------------------------------------------------------
def test_every_fused_path_mutant_names_gate_cases_a_cpu_can_check():
    gate = {c.id: c for c in load_suite("gate")}
    gate_cpu = {c.id for c in load_suite("gate-cpu")}
    fused = [m for m in mm.MUTANTS if mm.FUSED_PATH in m.providers and m.cp == 1]
    assert {m.name for m in fused} >= set(SEEDS)
    for m in fused:
        assert (1 <= len(m.gpu_cases) <= 2) != bool(m.no_gate_case), m.name
        assert set(m.gpu_cases) <= set(gate), m.name
        assert (set(m.gpu_cases) <= gate_cpu) == (m.name not in BEYOND_GATE_CPU or not m.gpu_cases), m.name
        assert all(gate[c].layout.num_tokens <= LARGER_GATE_CASE.get(m.name, 160) for c in m.gpu_cases), m.name
    # only the fused path's 1-rank mutants name gate cases (the unfused provider never runs on the real kernels; a
    # CP mutant needs several GPUs, which the one-GPU plan has not)
    assert all(not (m.gpu_cases or m.unreachable or m.no_gate_case) for m in mm.MUTANTS
               if mm.FUSED_PATH not in m.providers or m.cp > 1)


def test_the_dense_loss_seed_is_declared_unreachable_on_sm90_only():
    m = _mutant("thd_dense_bwd_no_max_seqlen")
    assert mm.gpu_plan((9, 0)).unreachable(m) and "dense indexer loss" in mm.gpu_plan((9, 0)).unreachable(m)
    assert mm.gpu_plan((10, 0)).unreachable(m) is None
    assert mm.CPU_PLAN.unreachable(m) is None  # the CPU plan (sm100 stand-in) runs it
    gate = {c.id: c for c in load_suite("gate")}
    assert all(gate[c].is_thd and gate[c].loss_mode == "dense" for c in m.gpu_cases)  # what sm90 refuses
    assert all(mm.gpu_plan((9, 0)).unreachable(_mutant(n)) is None for n in SEEDS[1:])


# ---- plans ------------------------------------------------------------------------------------------------------
def test_plans_choose_cases_providers_and_device():
    m = _mutant("invalid_comp_rows_by_count")
    assert mm.CPU_PLAN.jobs(m) == [(p, c, 1) for p in m.providers for c in m.cases]
    gpu = mm.gpu_plan((9, 0))
    assert gpu.jobs(m) == [("cudnn", c, 1) for c in m.gpu_cases]
    assert gpu.child() == {"suite": "gate", "device": "cuda", "stand_in_capability": None}
    preview = mm.preview_plan((9, 0))
    assert preview.jobs(m) == [("emulated", c, 1) for c in m.gpu_cases]
    assert preview.child() == {"suite": "gate", "device": "cpu", "stand_in_capability": [9, 0]}
    unfused_only = _mutant("sink_dropped_unfused")
    assert mm.CPU_PLAN.covers(unfused_only) and not gpu.covers(unfused_only)


def test_context_parallel_mutants_run_at_their_cp_size_on_the_cpu_plan_only():
    cp = [m for m in mm.MUTANTS if m.cp > 1]
    assert len(cp) >= 3 and all(m.cp == 2 for m in cp)
    for m in cp:  # the CPU plan runs each case at the mutant's CP size; a one-GPU plan cannot run CP at all
        assert mm.CPU_PLAN.jobs(m) == [(p, c, 2) for p in m.providers for c in m.cases]
        assert not mm.gpu_plan((9, 0)).covers(m) and not mm.preview_plan((9, 0)).covers(m)
    assert mm.gpu_plan((9, 0)).covers(_mutant("invalid_comp_rows_by_count"))  # control: a 1-rank fused one is


def _args(**kw):
    return argparse.Namespace(**{"provider": "torch", "capability": None, **kw})


def test_provider_option_selects_the_plan_with_clear_errors(monkeypatch):
    assert mm.plan_of(_args()) is mm.CPU_PLAN
    assert mm.plan_of(_args(provider="emulated")) == mm.preview_plan((9, 0))
    assert mm.plan_of(_args(provider="emulated", capability="10.0")) == mm.preview_plan((10, 0))
    with pytest.raises(ValueError, match="--capability 'sm90'"):
        mm.plan_of(_args(provider="emulated", capability="sm90"))
    with pytest.raises(ValueError, match="--provider unfused"):
        mm.plan_of(_args(provider="unfused"))
    from adapters.megatron import real_kernels

    monkeypatch.setattr(real_kernels, "unavailable_reason", lambda: "no CUDA device here")
    with pytest.raises(ValueError, match="--provider cudnn: no CUDA device here"):
        mm.plan_of(_args(provider="cudnn"))


# ---- verdicts ---------------------------------------------------------------------------------------------------
def _row(case_id, outcome, provider="cudnn", message=""):
    return {"case_id": case_id, "provider": provider, "outcome": outcome, "message": message}


def test_a_mutant_no_case_fails_survives():
    m = _mutant("fake_bshd_view_over_batch")
    jobs = mm.gpu_plan((9, 0)).jobs(m)
    assert mm._judge(m, ("cudnn",), jobs, [_row(c, "pass") for _, c, _ in jobs]).status == "survived"
    assert mm._judge(m, ("cudnn",), jobs, [_row(c, "unsupported") for _, c, _ in jobs]).status == "survived"
    killed = mm._judge(m, ("cudnn",), jobs, [_row(jobs[0][1], "fail", message="grad/x: rel_l2 fails")])
    assert killed.status == "killed" and killed.message == "grad/x: rel_l2 fails"


def test_an_unreachable_declaration_must_be_confirmed_by_the_clean_tree():
    m = _mutant("thd_dense_bwd_no_max_seqlen")
    plan, why = mm.gpu_plan((9, 0)), "refused"
    refused = mm._unreachable(m, why, [_row(c, "unsupported") for c in m.gpu_cases], plan)
    assert refused.status == "not reachable" and "sm90" in refused.message
    ran = mm._unreachable(m, why, [_row(m.gpu_cases[0], "pass")], plan)
    assert ran.status == "reachable after all" and "update Mutant.unreachable" in ran.message
    assert mm._unreachable(m, why, [], plan).status == "reachable after all"  # nothing confirmed it


def test_the_summary_counts_unreachable_mutants_apart_and_fails_on_a_survivor():
    plan = mm.gpu_plan((9, 0))
    out = [mm.Outcome("a", "killed"), mm.Outcome("b", "not reachable")]
    assert mm.summary(out, plan) == ("mutants: 1/1 killed on cudnn (sm90); 1 not reachable on sm90: b", True)
    line, ok = mm.summary(out + [mm.Outcome("c", "survived")], plan)
    assert line.startswith("mutants: 1/2 killed") and not ok
    assert not mm.summary([mm.Outcome("b", "reachable after all")], plan)[1]
    assert mm.summary([mm.Outcome("a", "killed")], mm.CPU_PLAN) == ("mutants: 1/1 killed", True)


# ---- the preview: the GPU plan's cases on the emulated kernels at sm90 --------------------------------------------
@needs_megatron
@pytest.mark.slow
def test_the_sm90_preview_kills_a_seed_mutant_and_not_a_no_op(monkeypatch):
    """The cudnn plan with the emulated provider declaring (9, 0): a seed mutant killed on its gate case (about
    2 x 60 s on a CPU, hence slow), the
    dense-loss seed reported not reachable (refused on the clean tree), and a no-op patch not killed (negative
    control: the kill comes from the patch, not from the plan)."""
    from adapters.megatron import source

    seed, dense = _mutant("fake_bshd_view_over_batch"), _mutant("thd_dense_bwd_no_max_seqlen")
    no_op = mm.Mutant("no_op", "a patch that changes nothing", seed.path, seed.old, seed.old, seed.providers,
                      seed.cases, nth=seed.nth, gpu_cases=SMALLEST_PASSING)
    monkeypatch.setattr(mm, "MUTANTS", (seed, dense, no_op))
    lines = []
    outcomes = {o.name: o for o in mm.run_suite(source.locate().root, echo=lines.append,
                                                 plan=mm.preview_plan((9, 0)))}
    assert outcomes["fake_bshd_view_over_batch"].status == "killed", "\n".join(lines)
    assert outcomes["thd_dense_bwd_no_max_seqlen"].status == "not reachable", "\n".join(lines)
    assert outcomes["no_op"].status == "survived", "\n".join(lines)


#: a gate-cpu case that passes on the clean tree in well under a second once Megatron is imported
SMALLEST_PASSING = ("3bf049a88f0f",)


# ---- the command line -----------------------------------------------------------------------------------------
@needs_megatron
def test_the_cudnn_plan_without_a_gpu_is_a_usage_error(capsys, monkeypatch):
    from adapters.megatron import real_kernels
    from cli.main import main

    monkeypatch.setattr(real_kernels, "unavailable_reason", lambda: "no CUDA device here")
    assert main(["mutants", "--impl", "megatron", "--provider", "cudnn"]) == 2
    assert "--provider cudnn: no CUDA device here" in capsys.readouterr().err


@needs_megatron
def test_the_list_shows_each_fused_mutant_s_gate_cases_or_why_unreachable(capsys):
    from cli.main import main

    assert main(["mutants", "--impl", "megatron", "--provider", "emulated", "--list"]) == 0
    out = capsys.readouterr().out
    for m in mm.MUTANTS:
        assert m.name in out
    assert "emulated (sm90): gate cases eb6b0817dc4e" in out
    assert "emulated (sm90): not reachable: production's config validation refuses" in out
    assert main(["mutants", "--impl", "megatron", "--list"]) == 0
    assert "gate cases" not in capsys.readouterr().out  # the CPU plan's listing is unchanged


def test_a_fused_mutant_without_a_gate_case_is_reported_and_not_killed(monkeypatch, tmp_path):
    import dataclasses

    m = dataclasses.replace(_mutant("compressor_real_offsets"), gpu_cases=(),
                            no_gate_case="no clean gate case reaches it")
    monkeypatch.setattr(mm, "MUTANTS", (m,))
    lines = []
    outcomes = mm.run_suite(tmp_path, echo=lines.append, plan=mm.preview_plan((9, 0)))
    assert [(o.name, o.status) for o in outcomes] == [(m.name, "no gate case")]
    assert m.no_gate_case in lines[-1]
    assert mm.summary(outcomes, mm.preview_plan((9, 0)))[1] is False


# ---- what a run leaves behind -----------------------------------------------------------------------------------
def test_the_outcomes_stream_into_the_kill_matrix_of_out(monkeypatch, tmp_path, capsys):
    """``--out DIR``: one ``mutants.jsonl`` row per mutant as it is judged, readable as the report's kill matrix
    (statuses folded into killed / survived / unreachable, the suite's own kept in ``detail``); a previous run's rows
    are not kept (negative control: the stale row is gone)."""
    from cli.main import main
    from reports.mutants import load_mutants

    out = tmp_path / "mut"
    out.mkdir()
    (out / "mutants.jsonl").write_text('{"mutant": "stale", "status": "survived"}\n')
    judged = [mm.Outcome("a", "killed", "eb6b0817dc4e", "cudnn", "grad/x: noise_floor_ratio 83 fails <= 3",
                         tensor="grad/x", check="noise_floor"),
              mm.Outcome("b", "not reachable", "b5e73394500d", message="on sm90: refused"),
              mm.Outcome("c", "survived", message="not killed on cudnn (1 runs)")]
    seen = []

    def fake_suite(root, names, echo=print, plan=mm.CPU_PLAN, record=None):
        for o in judged:  # the file holds each outcome before the next mutant runs
            record(o)
            seen.append(sum(1 for _ in (out / "mutants.jsonl").open()))
        return judged

    monkeypatch.setattr(mm, "locate", lambda path=None: type("S", (), {"root": tmp_path, "revision": "test"})())
    monkeypatch.setattr(mm, "run_suite", fake_suite)
    assert main(["mutants", "--impl", "megatron", "--out", str(out)]) == 1  # c survived
    assert seen == [1, 2, 3]
    report = load_mutants(out)
    assert dict(zip(report.mutants["mutant"], report.mutants["status"])) == {
        "a": "killed", "b": "unreachable", "c": "survived"}
    assert report.matrix.loc["a", "grad/x"] == 1
    rows = [json.loads(line) for line in (out / "mutants.jsonl").read_text().splitlines()]
    assert [r["detail"] for r in rows] == ["killed", "not reachable", "survived"]
    assert f"results: {out / 'mutants.jsonl'}" in capsys.readouterr().out


@pytest.mark.parametrize("flag", [["--case-id", "eb6b0817dc4e"], ["--suite", "gate"], ["--limit", "2"],
                                  ["--keep-going"], ["--device", "cuda"], ["--policy", "p.json"],
                                  ["--case", "{}"], ["--quiet"], ["--no-report"]])
def test_options_of_the_fused_suite_are_refused_with_megatron(monkeypatch, capsys, flag):
    """Each mutant runs on its own cases: a selection flag would be silently ignored, so it is an error naming it."""
    import cli.mutants_command as command
    from cli.main import main

    calls = []
    monkeypatch.setattr(command, "megatron_mutants", lambda args: calls.append(args) or 0)
    assert main(["mutants", "--impl", "megatron", *flag]) == 2
    assert f"{flag[0]}: not used with --impl megatron" in capsys.readouterr().err and not calls
    # negative control: without it the megatron suite is called
    assert main(["mutants", "--impl", "megatron", "--provider", "emulated"]) == 0 and len(calls) == 1


@pytest.mark.parametrize("status, folded", [
    ("killed", "killed"), ("not reachable", "unreachable"), ("survived", "survived"),
    ("reachable after all", "survived"), ("not applied", "survived"), ("no clean case", "survived"),
    ("no gate case", "survived")])
def test_only_a_confirmed_unreachable_mutant_is_unreachable_in_the_kill_matrix(status, folded):
    """A stale patch or a wrong unreachable declaration was not killed: the matrix shows it as survived (listed
    first), never as unreachable; the suite's own status stays in ``detail``."""
    row = mm.Outcome("m", status).row(mm.gpu_plan((9, 0)))
    assert (row["status"], row["detail"], row["plan"]) == (folded, status, "cudnn (sm90)")


def test_without_out_the_megatron_suite_writes_its_own_folder(monkeypatch, tmp_path):
    """Not the fused suite's reports/out/mutants, whose clean run and report would sit beside it."""
    from cli.main import main

    monkeypatch.chdir(tmp_path)
    fused_rows = tmp_path / "reports" / "out" / "mutants" / "mutants.jsonl"
    fused_rows.parent.mkdir(parents=True)
    fused_rows.write_text('{"mutant": "fused", "status": "killed"}\n')
    monkeypatch.setattr(mm, "locate", lambda path=None: type("S", (), {"root": tmp_path, "revision": "test"})())
    monkeypatch.setattr(mm, "run_suite", lambda root, names, echo=print, plan=mm.CPU_PLAN, record=None:
                        [record(o) or o for o in [mm.Outcome("a", "killed")]])
    assert main(["mutants", "--impl", "megatron"]) == 0
    assert (tmp_path / mm.DEFAULT_OUT / "mutants.jsonl").is_file()
    assert fused_rows.read_text().startswith('{"mutant": "fused"')  # the fused suite's matrix is untouched
