"""WorkerPool: N children, jobs streamed back as they finish, a crash / hang / error confined to its job.

The children are ``tests/parity/pool_child.py`` (the worker protocol without torch), so these tests take
milliseconds per child; the real worker runs in ``test_shard.py``'s end-to-end tests.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.shard import plan_slots
from parity.worker import WorkerPool

CHILD = [sys.executable, str(Path(__file__).with_name("pool_child.py"))]


def jobs(*specs):
    """``("a", "pass")`` → ``("a", {"id": "a", "do": "pass"})``; a third item is the sleep in seconds."""
    return [(s[0], {"id": s[0], "do": s[1], "sleep": s[2] if len(s) > 2 else 0.0}) for s in specs]


def run_all(pool, items):
    try:
        return {f.key: f for f in pool.run(items)}
    finally:
        pool.close()


def test_two_slots_share_the_jobs_and_every_job_comes_back_once():
    pool = WorkerPool(plan_slots(2, "cpu"), timeout=30, command=CHILD)
    done = run_all(pool, jobs(*[(f"j{i}", "pass", 0.05) for i in range(6)]))
    assert sorted(done) == [f"j{i}" for i in range(6)]
    assert all(f.rows[0]["case_id"] == key and f.why == "" for key, f in done.items())
    assert {f.slot.index for f in done.values()} == {0, 1}  # both workers took jobs
    assert pool.started == 2  # and were reused, not restarted: one process per slot
    for slot in (0, 1):
        assert len({f.rows[0]["pid"] for f in done.values() if f.slot.index == slot}) == 1


def test_results_stream_in_completion_order():
    """A slow first job does not hold back the fast ones behind it (the parent writes each as it ends)."""
    pool = WorkerPool(plan_slots(2, "cpu"), timeout=30, command=CHILD)
    try:
        order = [f.key for f in pool.run(jobs(("slow", "pass", 1.0), ("f1", "pass"), ("f2", "pass")))]
    finally:
        pool.close()
    assert order[-1] == "slow" and sorted(order[:2]) == ["f1", "f2"]


def test_a_crash_fails_only_its_job_and_the_slot_gets_a_fresh_worker():
    # two slots, both first jobs crash: the third job can only run on a replacement process
    pool = WorkerPool(plan_slots(2, "cpu"), timeout=30, command=CHILD)
    done = run_all(pool, jobs(("c1", "crash"), ("c2", "crash"), ("ok", "pass"), ("ok2", "pass")))
    for key in ("c1", "c2"):
        assert done[key].rows is None and "worker crashed (exit code 3)" in done[key].why
        assert "planted crash" in done[key].why  # the child's stderr tail explains it
    assert done["ok"].rows[0]["outcome"] == "pass" and done["ok2"].rows[0]["outcome"] == "pass"
    assert pool.started >= 3


def test_an_error_answer_retires_the_worker_but_a_pass_does_not():
    pool = WorkerPool(plan_slots(1, "cpu"), timeout=30, command=CHILD)
    done = run_all(pool, jobs(("p1", "pass"), ("p2", "pass"), ("e", "error"), ("p3", "pass")))
    pid = {k: f.rows[0]["pid"] for k, f in done.items()}
    assert pid["p1"] == pid["p2"] == pid["e"] != pid["p3"]  # negative control: p1/p2 shared one process
    assert done["e"].rows[0]["outcome"] == "error" and pool.started == 2


def test_fresh_mode_starts_a_process_per_job():
    pool = WorkerPool(plan_slots(1, "cpu"), timeout=30, fresh=True, command=CHILD)
    done = run_all(pool, jobs(("a", "pass"), ("b", "pass"), ("c", "pass")))
    assert len({f.rows[0]["pid"] for f in done.values()}) == 3 and pool.started == 3


def test_a_hung_job_times_out_and_the_sweep_continues():
    pool = WorkerPool(plan_slots(2, "cpu"), timeout=1.5, command=CHILD)
    done = run_all(pool, jobs(("hang", "hang"), ("a", "pass"), ("b", "pass")))
    assert done["hang"].rows is None and done["hang"].why.startswith("timed out after 1.5 s")
    assert done["a"].rows and done["b"].rows


def test_garbled_answers_and_stray_lines():
    pool = WorkerPool(plan_slots(1, "cpu"), timeout=30, command=CHILD)
    done = run_all(pool, jobs(("g", "garbage"), ("n", "noise"), ("s", "split"), ("p", "pass")))
    assert done["g"].rows is None and "unreadable answer" in done["g"].why
    assert done["n"].rows[0]["outcome"] == "pass"  # a stray stdout line is skipped, the answer still read
    assert done["s"].rows[0]["outcome"] == "pass"  # a half-arrived answer is waited for, not misread
    assert done["p"].rows[0]["outcome"] == "pass"


def test_slots_reach_the_children_environment():
    slots = plan_slots(3, "cuda", tokens=["4", "GPU-abc"], cpu_count=12)
    pool = WorkerPool(slots, timeout=30, command=CHILD)
    done = run_all(pool, jobs(*[(f"j{i}", "pass") for i in range(3)]))
    seen = {f.slot.index: f.rows[0]["env"] for f in done.values()}
    assert seen == {0: {"CUDA_VISIBLE_DEVICES": "4", "DSV4_PARITY_THREADS": "4", "OMP_NUM_THREADS": "4"},
                    1: {"CUDA_VISIBLE_DEVICES": "GPU-abc", "DSV4_PARITY_THREADS": "4", "OMP_NUM_THREADS": "4"},
                    2: {"CUDA_VISIBLE_DEVICES": "4", "DSV4_PARITY_THREADS": "4", "OMP_NUM_THREADS": "4"}}


PARENT = """
import sys, time
sys.path.insert(0, {repo!r})
from types import SimpleNamespace
from parity.worker import WorkerPool  # stdlib only: this parent starts in milliseconds
pool = WorkerPool([SimpleNamespace(index=0, device="cpu", env={env!r})], timeout=60, command={child!r})
jobs = pool.run([("h", {{"id": "h", "do": "hang"}})])
worker = pool.workers[0]
import threading
threading.Thread(target=lambda: next(jobs, None), daemon=True).start()
while worker.proc is None:
    time.sleep(0.01)
time.sleep(0.5)  # the child is inside the hanging job now
print(worker.proc.pid, flush=True)
"""


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_killed_run_leaves_no_worker_behind():
    """``timeout``/``kill`` of the parent must not leave a worker busy on a GPU: the child dies with it."""
    repo = str(Path(__file__).resolve().parents[2])

    def orphan(env):
        out = subprocess.run([sys.executable, "-c", PARENT.format(repo=repo, env=env, child=CHILD)],
                             capture_output=True, text=True, timeout=60)
        return int(out.stdout.strip())  # the parent exited (without closing anything) right after printing

    assert _gone(orphan({}), within=5.0)
    survivor = orphan({"POOL_CHILD_OUTLIVE_PARENT": "1"})  # negative control: no death signal
    try:
        assert not _gone(survivor, within=1.0)
    finally:
        os.kill(survivor, signal.SIGKILL)
