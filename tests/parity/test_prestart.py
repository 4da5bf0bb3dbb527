"""Worker children started before the run (parity.run.prestart): started for the slots the run will plan, adopted
only when they are exactly what a fresh child would be, and never a change to what a run computes.

The end-to-end check that a run of prestarted children gives a one-worker run's results case by case is
``test_shard.py::test_two_workers_give_one_workers_results_case_by_case_and_resume`` (it asserts both children were
prestarted); here: the plan, the adoption rule, its negative controls, and the child's warm-up.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main
from parity.run import placement, prestart
from parity.run.worker import SELF_SET, WARM_ENV, WorkerPool, children_for, same_child, spawn, warm_spec

REPO = Path(__file__).resolve().parents[2]
CHILD = [sys.executable, str(Path(__file__).with_name("pool_child.py"))]


def run_args(**given) -> argparse.Namespace:
    values = {"command": "run", "resume": False, "isolate": "auto", "device": "cpu", "workers": "2", "threads": None,
              "impl": "fused", "against": "reference", "provider": "torch", "case": [], "case_id": [], "limit": None}
    values.update(given)
    return argparse.Namespace(**values)


def fresh(workers, device, *, tokens=None, cpu_count=2, threads=None, impl="fused", provider="torch"):
    """What the runner starts for each slot (parity.run.runner._run_locked: the same children_for call)."""
    slots = placement.plan_slots(workers, device, threads=threads, tokens=tokens, cpu_count=cpu_count)
    return children_for(slots, warm_spec(impl, "reference", provider, device))


def test_the_guess_is_what_the_runner_starts_on_a_cpu_and_on_a_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    planned = prestart.planned_children(run_args(), gpus=0, cpu_count=2)
    wanted = fresh(2, "cpu")
    assert len(planned) == 2 and all(not same_child(p, w) for p, w in zip(planned, wanted))
    assert planned[0][1]["DSV4_PARITY_THREADS"] == "1" and json.loads(planned[0][1][WARM_ENV])["device"] == "cpu"
    # --device auto on a host whose driver lists one GPU, 16 cores: six children, each pinned, two threads each
    gpu = prestart.planned_children(run_args(device="auto", workers="auto", provider="cudnn"), gpus=1, cpu_count=16)
    wanted = fresh(6, "cuda", tokens=["0"], cpu_count=16, provider="cudnn")
    assert len(gpu) == 6 and all(not same_child(p, w) for p, w in zip(gpu, wanted))
    assert {env["CUDA_VISIBLE_DEVICES"] for _, env in gpu} == {"0"} and gpu[0][1]["DSV4_PARITY_THREADS"] == "2"
    # the parent's own pinning is kept: two of four listed GPUs visible, workers round-robin over them
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    two = prestart.planned_children(run_args(device="cuda", workers="4"), gpus=4, cpu_count=16)
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in two] == ["2", "3", "2", "3"]


@pytest.mark.parametrize("given", [
    {"resume": True},  # the recorded run decides its options
    {"workers": "1"},  # one worker: in this process on a CPU, an unpinned child on a GPU
    {"workers": "auto"},  # auto on a CPU is one worker
    {"isolate": "none"}, {"isolate": "case"},
    {"case_id": ["abc"]},  # one case: one worker's work
    {"limit": 1},
    {"command": "metamorphic"},
])
def test_nothing_is_started_where_the_run_would_not_use_it(given):
    assert prestart.planned_children(run_args(**given), gpus=0, cpu_count=2) == []


def test_the_switch_turns_it_off(monkeypatch):
    assert prestart.planned_children(run_args(), gpus=0) != []  # the control: on by default
    monkeypatch.setenv(prestart.SWITCH_ENV, "0")
    assert prestart.planned_children(run_args(), gpus=0) == []


def test_a_selection_smaller_than_the_workers_starts_only_what_it_uses():
    assert len(prestart.planned_children(run_args(workers="4", limit=2), gpus=0, cpu_count=8)) == 2
    assert len(prestart.planned_children(run_args(workers="4", case_id=["a", "b", "c"]), gpus=0, cpu_count=8)) == 3


def test_same_child_ignores_only_what_the_child_sets_itself():
    env = {"PATH": "/bin", "DSV4_PARITY_THREADS": "2"}
    assert same_child((["py"], env), (["py"], dict(env))) == []
    # the parent set a determinism variable after the child started: the child sets the same one itself
    assert same_child((["py"], env), (["py"], dict(env, CUBLAS_WORKSPACE_CONFIG=":4096:8"))) == []
    # negative controls: a pin, a thread count, a value of a self-set variable the child was given, a command
    assert same_child((["py"], env), (["py"], dict(env, CUDA_VISIBLE_DEVICES="1"))) == ["CUDA_VISIBLE_DEVICES"]
    assert same_child((["py"], env), (["py"], dict(env, DSV4_PARITY_THREADS="4"))) == ["DSV4_PARITY_THREADS"]
    # ... but only to the value the child gives it itself
    assert same_child((["py"], env), (["py"], dict(env, CUBLAS_WORKSPACE_CONFIG=":16:8"))) == [
        "CUBLAS_WORKSPACE_CONFIG"]
    cache = dict(env, DSV4_PARITY_CACHE_DIR="/c")
    assert same_child((["py"], cache), (["py"], dict(cache, TRITON_CACHE_DIR="/c/triton"))) == []
    assert same_child((["py"], cache), (["py"], dict(cache, TRITON_CACHE_DIR="/elsewhere"))) == ["TRITON_CACHE_DIR"]
    given = dict(env, CUBLAS_WORKSPACE_CONFIG=":16:8")
    assert same_child((["py"], given), (["py"], dict(env, CUBLAS_WORKSPACE_CONFIG=":4096:8"))) == [
        "CUBLAS_WORKSPACE_CONFIG"]
    assert same_child((["py"], given), (["py"], env)) == ["CUBLAS_WORKSPACE_CONFIG"]  # unset since: not the same
    assert same_child((["py"], env), (["py", "-X"], env)) == ["command"]


def test_what_a_child_sets_itself_is_all_in_self_set(tmp_path):
    """The variables the engine's configure_torch and the compile cache set for themselves are SELF_SET's (a new
    one there would make every early child differ from a fresh one: never adopted)."""
    code = ("import os, json; before = set(os.environ)\n"
            "from parity.engine import configure_torch; configure_torch()\n"
            "from fused.kernels import compile_cache; compile_cache.configure_environment()\n"
            "print(json.dumps({k: os.environ[k] for k in sorted(set(os.environ) - before)}))")
    env = {k: v for k, v in os.environ.items() if k not in SELF_SET}
    env.update(PYTHONPATH=str(REPO), DSV4_PARITY_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    added = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"CUBLAS_WORKSPACE_CONFIG", "CUTE_DSL_CACHE_DIR"} <= set(added)  # the control: it did set them
    assert set(added) <= set(SELF_SET), set(added) - set(SELF_SET)
    assert {k: SELF_SET[k](env) for k in added} == added  # ... to the values SELF_SET expects


def idle_child() -> list:
    return [sys.executable, "-c", "import sys; sys.stdin.read()"]


def test_assign_hands_out_only_identical_children_and_stops_the_rest():
    env = dict(os.environ, DSV4_PARITY_THREADS="1")
    early = prestart.Prestart([spawn(idle_child(), env), spawn(idle_child(), dict(env, DSV4_PARITY_THREADS="7"))])
    children = list(early.children)
    taken, differs = early.assign([(idle_child(), env), (idle_child(), dict(env, DSV4_PARITY_THREADS="2"))])
    try:
        assert taken[0] is children[0] and taken[0].alive
        assert taken[1] is None and differs == ["DSV4_PARITY_THREADS"]  # the second child was not the same
        assert children[1].proc.poll() is not None and early.children == []  # ... and is stopped at once
    finally:
        taken[0].proc.kill()
        taken[0].proc.wait()
    # all taken: nothing to report
    again = prestart.Prestart([spawn(idle_child(), env)])
    taken, differs = again.assign([(idle_child(), env)])
    assert differs == [] and taken[0].alive
    taken[0].proc.kill()
    taken[0].proc.wait()


def test_the_pool_runs_its_first_job_in_the_early_child_and_replaces_a_dead_one():
    slots = placement.plan_slots(2, "cpu")
    alive = spawn(CHILD, dict(os.environ, **slots[0].env))
    dead = spawn([sys.executable, "-c", "pass"], dict(os.environ))
    dead.proc.wait()
    pool = WorkerPool(slots, timeout=30, command=CHILD, spares=[alive, dead])
    try:
        done = {f.key: f for f in pool.run([(k, {"id": k, "do": "pass", "sleep": 0.2}) for k in ("a", "b")])}
    finally:
        pool.close()
    assert {f.rows[0]["outcome"] for f in done.values()} == {"pass"}
    by_slot = {f.slot.index: f.rows[0]["pid"] for f in done.values()}
    assert by_slot[0] == alive.proc.pid  # the early child ran slot 0's job
    assert by_slot[1] != dead.proc.pid  # slot 1's had died: a fresh child ran it
    assert pool.started == 2 and pool.adopted == 1


def test_a_run_whose_early_children_differ_starts_fresh_ones_and_says_why(tmp_path, monkeypatch, capsys):
    real = prestart.planned_children

    def wrong(args, *a, **k):  # children that guessed another thread count
        return [(command, dict(env, DSV4_PARITY_THREADS="3")) for command, env in real(args, *a, **k)]

    monkeypatch.setattr(prestart, "planned_children", wrong)
    out = tmp_path / "run"
    assert main(["run", "--suite", "smoke", "--limit", "2", "--workers", "2", "--device", "cpu", "--provider", "torch",
                 "--out", str(out)]) == 0
    end = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()][-1]
    assert end["occupancy"]["prestarted"] == 0 and end["occupancy"]["processes_started"] == 2
    assert "2 of 2 worker(s) started anew" in capsys.readouterr().err


def test_the_warm_up_prepares_the_process_and_a_failing_one_is_only_a_note():
    code = ("import sys, json\n"
            "from parity.run.worker import warm_up\n"
            "from parity.run.execution import load_impl\n"
            "warm_up(sys.argv[1])\n"
            "print(json.dumps({'dynamo': 'torch._dynamo' in sys.modules, 'impls': load_impl.cache_info().currsize}))")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    good = warm_spec("fused", "reference", "torch", "cpu")
    out = subprocess.run([sys.executable, "-c", code, good], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"dynamo": True, "impls": 2}
    assert "warm-up:" not in out.stderr
    bad = warm_spec("no.such.module", "reference", "torch", "cpu")
    out = subprocess.run([sys.executable, "-c", code, bad], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "warm-up: ImplError: cannot import implementation 'no.such.module'" in out.stderr


def test_the_early_start_loads_no_torch():
    """It runs before the command line loads torch; so must everything it imports (negative control: the cost
    order, parity.run.shard, needs the cases, which load torch)."""
    code = "import sys, {module}; print('torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    loaded = {m: subprocess.run([sys.executable, "-c", code.format(module=m)], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=120).stdout.strip() for m in ("parity.run.prestart", "parity.run.shard")}
    assert loaded == {"parity.run.prestart": "False", "parity.run.shard": "True"}


def test_children_are_stopped_when_one_cannot_start(monkeypatch):
    started = []
    real = prestart.spawn

    def flaky(command, env):
        if started:
            raise OSError("no more processes")
        started.append(real(command, env))
        return started[-1]

    monkeypatch.setattr(prestart, "spawn", flaky)
    with pytest.raises(OSError):
        prestart.Prestart.spawn([(idle_child(), dict(os.environ))] * 3)
    assert len(started) == 1 and started[0].proc.poll() is not None  # the one that started is stopped


def test_a_usage_error_after_the_early_start_stops_its_children_and_weighs_memory_as_before_them(tmp_path,
                                                                                                 monkeypatch, capsys):
    """The run's memory check reads the host as it was before its workers started (they hold memory of their
    own); a run refused by that check ends with its early children stopped."""
    made = []
    real = prestart.Prestart.spawn.__func__

    def keep(cls, planned):
        made.append(real(cls, planned))
        return made[-1]

    monkeypatch.setattr(prestart.Prestart, "spawn", classmethod(keep))
    monkeypatch.setattr(prestart, "host_available_bytes", lambda: 1024)  # 1 KiB before the children started
    argv = ["run", "--suite", "smoke", "--limit", "2", "--workers", "2", "--device", "cpu", "--provider", "torch",
            "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    assert "cannot fit in host memory" in capsys.readouterr().err
    assert len(made) == 1 and len(made[0].children) == 0  # handed to nobody: stopped
    # the control: without the early start the check reads the host now, and the run goes ahead
    monkeypatch.setenv(prestart.SWITCH_ENV, "0")
    assert main([*argv[:-1], str(tmp_path / "again")]) == 0 and len(made) == 1


def test_the_parent_points_the_compile_caches_before_torch_picks_its_own(tmp_path):
    """``point_compile_caches`` gives each unset compile-cache variable the value a child gives it itself and keeps a
    user's; in a process that calls it before importing ``torch._dynamo``, torch keeps the project's inductor cache.
    Negative control: without it, importing ``torch._dynamo`` sets torch's default, which makes a fresh child differ
    from one started before (``same_child`` names the variable)."""
    from parity.run.worker import COMPILE_CACHE_DIRS, point_compile_caches

    env = {"HOME": str(tmp_path), "TRITON_CACHE_DIR": "/mine"}
    assert point_compile_caches(env) == {k: SELF_SET[k](env) for k in COMPILE_CACHE_DIRS if k != "TRITON_CACHE_DIR"}
    assert env["TRITON_CACHE_DIR"] == "/mine" and env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / ".cache" /
                                                                                      "dsv4-parity" / "inductor")
    code = ("import os, sys\n"
            "from parity.run.worker import point_compile_caches\n"
            "if sys.argv[1] == 'point': point_compile_caches()\n"
            "import torch._dynamo\n"
            "print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))")
    base = {k: v for k, v in os.environ.items() if k not in SELF_SET}
    base.update(PYTHONPATH=str(REPO), DSV4_PARITY_CACHE_DIR=str(tmp_path / "cache"))
    seen = {how: subprocess.run([sys.executable, "-c", code, how], cwd=REPO, env=base, capture_output=True, text=True,
                                timeout=300).stdout.strip().splitlines()[-1] for how in ("point", "not")}
    assert seen["point"] == str(tmp_path / "cache" / "inductor")
    assert seen["not"] != seen["point"] and seen["not"] != "None"  # torch set its own default
    assert same_child((["x"], base), (["x"], dict(base, TORCHINDUCTOR_CACHE_DIR=seen["not"]))) == \
        ["TORCHINDUCTOR_CACHE_DIR"]
    assert same_child((["x"], base), (["x"], dict(base, TORCHINDUCTOR_CACHE_DIR=seen["point"]))) == []
