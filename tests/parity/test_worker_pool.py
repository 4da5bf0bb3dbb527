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

from parity.run.placement import plan_slots
from parity.run.worker import WorkerPool, is_out_of_memory

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


# ---- out of GPU memory on a shared GPU: re-run alone -----------------------------------------------------------------
#: ``str`` of the ``torch.OutOfMemoryError`` that torch 2.11.0+cu130 raised on an H200 for
#: ``torch.empty(1 << 45, dtype=torch.uint8, device="cuda")`` (verbatim, double spaces included)
TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 32768.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 139.29 GiB "
    "is free. Including non-PyTorch memory, this process has 518.00 MiB memory in use. Of the allocated memory 0 bytes "
    "is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If reserved but unallocated memory "
    "is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
    "for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-"
    "pytorch-cuda-alloc-conf)")
#: what c10's CUDA_CHECK raises for cudaErrorMemoryAllocation (a kernel launch or a library's own cudaMalloc)
CUDA_RUNTIME_OOM = (
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\nCompile with "
    "`TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")


def _engine_row(monkeypatch, exc):
    """The case row that ``parity.run.execution.execute`` (what a worker child runs) writes when the implementation's run
    raises ``exc``: the real engine path, on CPU."""
    from dataclasses import asdict

    from parity import engine
    from parity.run.execution import execute
    from tests.parity.helpers import pick

    def raising(*args, **kwargs):
        raise exc

    monkeypatch.setattr(engine, "take_snapshot", raising)
    case = pick("smoke")
    return execute({"case": case.to_dict(), "options": asdict(engine.RunOptions(device="cpu")), "oracle": None})[0]


def test_an_implementation_that_needs_more_than_the_whole_gpu_is_unsupported_there(monkeypatch):
    """torch's message bounds the implementation's need from below (held + asked); past the GPU's capacity no re-run
    can do the case on this GPU: ``unsupported`` (rule ``device-memory``), one reason per GPU model for the coverage
    gate (per stage: integers read as N; a baseline is one GPU model's), torch's own message kept in
    ``first_failure``. Controls: a need that fits stays an ``error`` (the pool
    re-runs it alone), and the harness's own phases running out stay an ``error`` whatever the need."""
    import torch

    from parity import engine
    from reports.coverage_gate import reason_key
    from tests.parity.pool_child import OOM, OOM_BEYOND

    row = _engine_row(monkeypatch, torch.OutOfMemoryError(OOM_BEYOND))
    assert (row["outcome"], row["decided_by"]) == ("unsupported", "device-memory")
    assert row["message"] == ("fused run: does not fit the GPU's 79 GiB even alone: needs at least 82 GiB of GPU "
                              "memory (held + asked when it ran out); a larger GPU runs it")
    # control: one request past the whole card is a size fault of the code under test, not a need: an error
    absurd = _engine_row(monkeypatch, torch.OutOfMemoryError(TORCH_OOM))  # 32768 GiB asked of a 139.80 GiB GPU
    assert absurd["outcome"] == "error" and absurd["decided_by"] == "error"
    assert row["failed_at"] == {"stage": "fused run", "implementation_run": True}
    assert "Tried to allocate 19.61 GiB" in row["first_failure"]["message"]
    other = _engine_row(monkeypatch, torch.OutOfMemoryError(OOM_BEYOND.replace("19.61 GiB", "23.07 GiB")))
    assert other["outcome"] == "unsupported" and other["message"] != row["message"]
    assert reason_key(other["message"]) == reason_key(row["message"])  # one reason, whatever the need
    # controls: a need that fits the GPU; the reference (the harness's own phase) needing more than the GPU
    assert _engine_row(monkeypatch, torch.OutOfMemoryError(OOM))["outcome"] == "error"
    monkeypatch.undo()

    def reference_beyond(*args, **kwargs):
        raise torch.OutOfMemoryError(OOM_BEYOND)

    monkeypatch.setattr(engine, "reference_runs", reference_beyond)
    from dataclasses import asdict

    from parity.run.execution import execute
    from tests.parity.helpers import pick

    ref = execute({"case": pick("smoke").to_dict(), "options": asdict(engine.RunOptions(device="cpu")),
                   "oracle": None})[0]
    assert ref["outcome"] == "error" and ref["message"].startswith("reference runs: OutOfMemoryError")
    assert ref["failed_at"] == {"stage": "reference runs", "implementation_run": False}
    assert is_out_of_memory(ref)


def test_out_of_memory_is_recognised_in_the_rows_the_engine_writes(monkeypatch):
    import torch

    row = _engine_row(monkeypatch, torch.OutOfMemoryError(TORCH_OOM.replace("32768.00 GiB", "2.00 GiB")))  # fits
    assert row["outcome"] == "error" and row["message"].startswith("fused run: OutOfMemoryError: CUDA out of memory.")
    assert is_out_of_memory(row)
    assert is_out_of_memory(_engine_row(monkeypatch, torch.cuda.OutOfMemoryError("Tried to allocate 2.00 GiB")))
    assert is_out_of_memory(_engine_row(monkeypatch, RuntimeError(CUDA_RUNTIME_OOM)))
    # cuBLAS's handle creation on a GPU whose memory other workers hold (the H100 gate of 2026-12-06)
    assert is_out_of_memory(_engine_row(monkeypatch, RuntimeError(
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")))
    assert is_out_of_memory({"outcome": "error", "message": "", "first_failure": {"message": "CUDA out of memory."}})
    # negative controls: other CUDA / Triton faults, and an out-of-memory text on a row that is not an error
    for other in (RuntimeError("CUDA error: an illegal memory access was encountered"),
                  RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, ...)`"),
                  RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448. Reducing "
                               "block sizes or `num_stages` may help."),
                  MemoryError()):
        assert not is_out_of_memory(_engine_row(monkeypatch, other)), other
    assert not is_out_of_memory(dict(row, outcome="fail"))
    assert not is_out_of_memory(None)


def oom_jobs(tmp_path, *specs):
    """``(id, do, sleep[, extra])`` jobs that log their start / end to ``tmp_path / "log"``."""
    items = []
    for spec in specs:
        request = {"id": spec[0], "do": spec[1], "sleep": spec[2], "log": str(tmp_path / "log"),
                   "flag": str(tmp_path / f"{spec[0]}.flag")}
        request.update(spec[3] if len(spec) > 3 else {})
        items.append((spec[0], request))
    return items


def events(tmp_path):
    """The children's log: ``[(start|end, id, pid, CUDA_VISIBLE_DEVICES)]`` in the order they happened."""
    return [tuple(line.split()) for line in (tmp_path / "log").read_text().splitlines()]


def run_list(pool, items, started=None):
    """Every :class:`Finished` in yield order; ``started`` collects ``(key, device, [alive per worker])`` as each
    job is handed out."""
    hook = None
    if started is not None:
        def hook(key, slot):
            started.append((key, slot.device, [w.alive for w in pool.workers]))
    try:
        return list(pool.run(items, on_start=hook))
    finally:
        pool.close()


def test_out_of_memory_on_a_shared_gpu_is_re_run_alone_on_it(tmp_path):
    # cuda:0 is shared by workers 0 and 2, cuda:1 has worker 1 alone; "big" runs out of memory on its first run only
    slots = plan_slots(3, "cuda", tokens=["0", "1"], cpu_count=12)
    items = oom_jobs(tmp_path, ("big", "oom_once", 0.5), *[(f"f{i}", "pass", 0.2) for i in range(10)])
    started = []
    done = run_list(WorkerPool(slots, timeout=30, command=CHILD), items, started)

    assert sorted(f.key for f in done) == sorted(k for k, _ in items)  # each job yielded once: not the OOM answer
    big = next(f for f in done if f.key == "big")
    note = "out of memory while sharing cuda:0 with 2 workers; re-run alone"
    assert big.rows[0]["outcome"] == "pass" and big.rows[0]["retried"] == note and big.retried == note
    assert big.slot.device == "cuda:0"
    assert all(f.retried is None and "retried" not in f.rows[0] for f in done if f.key != "big")
    assert [device for key, device, _ in started if key == "big"] == ["cuda:0", "cuda:0"]

    log = events(tmp_path)
    assert [e[0] for e in log if e[1] == "big"] == ["start", "end", "start", "end"]
    first, retry = [n for n, e in enumerate(log) if e[:2] == ("start", "big")]
    retry_end = max(n for n, e in enumerate(log) if e[:2] == ("end", "big"))
    on_gpu0 = [e[1] for e in log if e[3] == "0"]
    assert on_gpu0.count("big") == 4
    # alone: every other job on GPU 0 that started before the retry had ended before it, and none started or ended
    # on GPU 0 while it ran
    for n, e in enumerate(log[:retry]):
        if e[0] == "start" and e[3] == "0" and e[1] != "big":
            assert any(x[:2] == ("end", e[1]) for x in log[n:retry]), f"{e[1]} still ran on GPU 0 at the retry"
    assert [e for e in log[retry + 1:retry_end] if e[3] == "0"] == []
    # the other idle child of GPU 0 stayed up for the re-run (it gave its cached blocks back after its case)
    alive_at_retry = [alive for key, _, alive in started if key == "big"][1]
    assert alive_at_retry[2] is True


def test_a_re_run_keeps_the_idle_children_and_only_a_second_out_of_memory_stops_them(tmp_path):
    """The re-run alone goes to an idle worker of the GPU whose child stays up, as do its siblings' (no process
    start, no kernels loaded again); a re-run that runs out of memory again runs a third time with every idle child
    of the GPU stopped, in a fresh child (strict). Control: the first re-run's own child had run a case before."""
    slots = plan_slots(2, "cuda", tokens=["0"], cpu_count=8)
    items = oom_jobs(tmp_path, ("big", "oom_once", 0.3), ("a", "pass", 0.0))
    started = []
    done = run_list(WorkerPool(slots, timeout=30, command=CHILD), items, started)
    assert sorted(f.key for f in done) == ["a", "big"]
    assert started[0][:2] == ("big", "cuda:0") and started[1][:2] == ("a", "cuda:0")
    assert started[2][0] == "big" and started[2][2] == [False, True]  # "big"'s child stopped (an error), "a"'s up
    pids = {f.key: f.rows[0]["pid"] for f in done}
    assert pids["big"] == pids["a"]  # the re-run ran in the child that ran "a": no process started for it

    (tmp_path / "twice").mkdir()
    again = {"then": "oom", "flag": str(tmp_path / "twice" / "flag")}
    items = oom_jobs(tmp_path / "twice", ("big", "oom_once", 0.3, again), ("a", "pass", 0.0))
    started = []
    pool = WorkerPool(slots, timeout=30, command=CHILD)
    done = run_list(pool, items, started)
    big = next(f for f in done if f.key == "big")
    assert [key for key, _, _ in started] == ["big", "a", "big", "big"]
    assert started[2][2] == [False, True] and started[3][2] == [False, False]  # the strict re-run: none up
    runs = [e for e in events(tmp_path / "twice") if e[1] == "big"]
    assert [e[0] for e in runs] == ["start", "end"] * 3
    assert runs[4][2] not in {e[2] for e in events(tmp_path / "twice")[:events(tmp_path / "twice").index(runs[4])]}
    assert big.rows[0]["retried"] == ("out of memory while sharing cuda:0 with 2 workers; re-run alone; out of memory "
                                      "again beside the idle workers: re-run with them stopped")
    assert big.rows[0]["outcome"] == "error" and is_out_of_memory(big.rows[0])


@pytest.mark.parametrize("slots", [plan_slots(2, "cuda", tokens=["0", "1"]), plan_slots(1, "cuda", tokens=["0"])],
                         ids=["a GPU each", "one worker"])
def test_out_of_memory_without_sharing_is_yielded_as_is(tmp_path, slots):
    items = oom_jobs(tmp_path, ("oom", "oom", 0.0), ("p", "pass", 0.0))
    done = run_list(WorkerPool(slots, timeout=30, command=CHILD), items)
    assert sorted(f.key for f in done) == ["oom", "p"]
    oom = next(f for f in done if f.key == "oom")
    assert oom.rows[0]["outcome"] == "error" and is_out_of_memory(oom.rows[0])
    assert "retried" not in oom.rows[0] and oom.retried is None
    assert [e[0] for e in events(tmp_path) if e[1] == "oom"] == ["start", "end"]  # ran once


def test_another_error_on_a_shared_gpu_is_yielded_as_is(tmp_path):
    items = oom_jobs(tmp_path, ("e", "error", 0.0), ("p", "pass", 0.0))
    done = run_list(WorkerPool(plan_slots(2, "cuda", tokens=["0"]), timeout=30, command=CHILD), items)
    assert sorted(f.key for f in done) == ["e", "p"]
    e = next(f for f in done if f.key == "e")
    assert e.rows[0]["outcome"] == "error" and "retried" not in e.rows[0] and e.retried is None
    assert [x[0] for x in events(tmp_path) if x[1] == "e"] == ["start", "end"]


def test_a_retry_that_runs_out_of_memory_again_is_yielded(tmp_path):
    items = oom_jobs(tmp_path, ("oom", "oom", 0.0), *[(f"p{i}", "pass", 0.05) for i in range(4)])
    done = run_list(WorkerPool(plan_slots(2, "cuda", tokens=["0"]), timeout=30, command=CHILD), items)
    assert sorted(f.key for f in done) == ["oom", "p0", "p1", "p2", "p3"]  # once each: no second retry, no loop
    oom = next(f for f in done if f.key == "oom")
    assert oom.rows[0]["outcome"] == "error" and is_out_of_memory(oom.rows[0])
    assert oom.rows[0]["retried"] == ("out of memory while sharing cuda:0 with 2 workers; re-run alone; out of memory "
                                      "again beside the idle workers: re-run with them stopped")
    assert [e[0] for e in events(tmp_path) if e[1] == "oom"] == ["start", "end"] * 3  # shared, alone, strict


def test_the_implementation_running_out_of_memory_alone_on_the_gpu_does_not_fit_it(tmp_path):
    """A case whose implementation run (the row's ``failed_at``) runs out of memory again alone on the GPU, within 10 %
    of its capacity by torch's numbers, does not fit that GPU (1c5cbcb11f97: 78.05 of 79.18 GiB, out of memory alone on
    an H100, 2026-12-06): the re-run's row is ``unsupported`` (rule ``device-memory``), in a fresh child. The same holds
    on a GPU with one worker (it ran alone). Controls: the harness's own phases stay an ``error``; so does a need far
    under the capacity with other processes holding the memory (someone else's memory, not the case's need)."""
    impl = {"failed_at": {"stage": "megatron run", "implementation_run": True}}
    harness = {"failed_at": {"stage": "reference runs", "implementation_run": False}}
    items = oom_jobs(tmp_path, ("impl", "oom_alone", 0.0, impl), ("ref", "oom_alone", 0.0, harness),
                     ("held", "oom", 0.0, impl), ("p", "pass", 0.0))
    done = {f.key: f for f in run_list(WorkerPool(plan_slots(2, "cuda", tokens=["0"]), timeout=30, command=CHILD),
                                       items)}
    row = done["impl"].rows[0]
    assert (row["outcome"], row["decided_by"]) == ("unsupported", "device-memory") and row["retried"]
    assert row["message"] == ("megatron run: does not fit the GPU's 79 GiB even alone: needs at least 79 GiB of GPU "
                              "memory (held + asked when it ran out); a larger GPU runs it")
    assert row["first_failure"]["message"].startswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 18.83")
    runs = [e for e in events(tmp_path) if e[1] == "impl"]
    assert [e[0] for e in runs] == ["start", "end"] * 3  # re-run beside the idle children, then without them
    first_pids = {e[2] for e in events(tmp_path)[:events(tmp_path).index(runs[4])]}
    assert runs[4][2] not in first_pids  # the strict re-run started in a child that had run nothing before
    assert done["impl"].rows[0]["retried"].endswith("re-run with them stopped")
    assert done["ref"].rows[0]["outcome"] == "error" and done["ref"].rows[0]["retried"]
    assert done["held"].rows[0]["outcome"] == "error" and done["held"].rows[0]["retried"]
    # one worker on the GPU: no re-run, the first answer had the GPU to itself
    (tmp_path / "one").mkdir()
    items = oom_jobs(tmp_path / "one", ("impl", "oom_alone", 0.0, impl), ("ref", "oom_alone", 0.0, harness))
    alone = {f.key: f for f in run_list(WorkerPool(plan_slots(1, "cuda", tokens=["0"]), timeout=30, command=CHILD),
                                        items)}
    assert alone["impl"].rows[0]["outcome"] == "unsupported" and "retried" not in alone["impl"].rows[0]
    assert alone["ref"].rows[0]["outcome"] == "error"


def test_a_retry_that_crashes_is_yielded_with_its_note(tmp_path):
    items = oom_jobs(tmp_path, ("big", "oom_once", 0.0, {"then": "crash"}), ("p", "pass", 0.0))
    done = run_list(WorkerPool(plan_slots(2, "cuda", tokens=["0"]), timeout=30, command=CHILD), items)
    big = next(f for f in done if f.key == "big")
    assert big.rows is None and "worker crashed (exit code 3)" in big.why
    assert big.retried == "out of memory while sharing cuda:0 with 2 workers; re-run alone"


def test_a_retry_is_not_read_from_the_jobs_and_the_budget_cannot_drop_it(tmp_path):
    """``jobs`` is still read lazily: a generator that stops (a time budget) stops new work, not a pending retry."""
    items = oom_jobs(tmp_path, ("big", "oom_once", 0.3), ("a", "pass", 0.0), ("never", "pass", 0.0))
    handed = []

    def budget():
        for item in items:
            if item[0] == "never":  # the budget ran out
                return
            handed.append(item[0])
            yield item

    done = run_list(WorkerPool(plan_slots(2, "cuda", tokens=["0"]), timeout=30, command=CHILD), budget())
    assert sorted(f.key for f in done) == ["a", "big"] and handed == ["big", "a"]
    assert next(f for f in done if f.key == "big").rows[0]["retried"]


PARENT = """
import sys, time
sys.path.insert(0, {repo!r})
from types import SimpleNamespace
from parity.run.worker import WorkerPool  # stdlib only: this parent starts in milliseconds
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


def test_a_case_that_needs_more_than_the_whole_gpu_is_not_re_run_alone(tmp_path):
    """torch's message says what the process held and asked for: past the GPU's capacity a re-run alone would only run
    out again (and hold the device's other workers back), so the row is yielded at once, saying why. Control: the
    fitting message of the other tests is re-run alone (above); here both kinds run in one pool."""
    from parity.run.out_of_memory import beyond_device, least_need

    items = oom_jobs(tmp_path, ("huge", "oom_beyond", 0.0), ("big", "oom_once", 0.2), ("p", "pass", 0.0))
    done = run_list(WorkerPool(plan_slots(2, "cuda", tokens=["0"]), timeout=30, command=CHILD), items)
    assert sorted(f.key for f in done) == ["big", "huge", "p"]
    huge = next(f for f in done if f.key == "huge")
    assert huge.rows[0]["outcome"] == "error" and is_out_of_memory(huge.rows[0])
    assert "retried" not in huge.rows[0] and huge.retried is None
    assert "needs at least 82 GiB of GPU memory" in huge.rows[0]["message"]  # 81.77 GiB rounded up
    assert "more than the GPU's 79 GiB" in huge.rows[0]["message"] and "not re-run alone" in huge.rows[0]["message"]
    assert [e[0] for e in events(tmp_path) if e[1] == "huge"] == ["start", "end"]  # ran once
    big = next(f for f in done if f.key == "big")
    assert big.rows[0]["retried"] and big.rows[0]["outcome"] == "pass"  # control: a case that fits was re-run
    # on a GPU with one worker no re-run alone was in question: no "not re-run alone" note (found by review)
    (tmp_path / "one").mkdir()
    alone = run_list(WorkerPool(plan_slots(1, "cuda", tokens=["0"]), timeout=30, command=CHILD),
                     oom_jobs(tmp_path / "one", ("huge", "oom_beyond", 0.0)))
    assert alone[0].rows[0]["outcome"] == "error" and "not re-run alone" not in alone[0].rows[0]["message"]
    # the bound: PyTorch's allocation (else the whole process) plus the request; None for any other text
    from tests.parity.pool_child import OOM, OOM_BEYOND

    gib = 1 << 30
    assert least_need(OOM_BEYOND) == (int(62.16 * gib) + int(19.61 * gib), int(79.18 * gib))
    assert least_need(OOM) == (int(5.92 * gib) + int(4.97 * gib), int(139.80 * gib)) and beyond_device(OOM) is None
    assert least_need(TORCH_OOM) == (0 + 32768 * gib, int(139.80 * gib)) and beyond_device(TORCH_OOM)
    assert least_need(CUDA_RUNTIME_OOM) is None and beyond_device("CUBLAS_STATUS_ALLOC_FAILED") is None


# ---- memory admission: jobs wait for GPU memory instead of running out of it ----------------------------------------
GIB = 1 << 30


def pool_view(pool, items):
    """The pool's own sequence of ``("start", key)`` (handed out) and ``("end", key)`` (yielded) events: exact,
    whatever the children's timing."""
    seen = []
    try:
        for done in pool.run(items, on_start=lambda key, slot: seen.append(("start", key))):
            seen.append(("end", done.key))
    finally:
        pool.close()
    return seen


def running_weights(seen, weights):
    """After each event: the summed weight of the jobs handed out and not yet ended, and how many they are."""
    running, out = set(), []
    for event, key in seen:
        (running.add if event == "start" else running.discard)(key)
        out.append((sum(weights[k] for k in running), len(running)))
    return out


def weighed(weights, sleeps):
    return [(k, {"id": k, "do": "pass", "sleep": sleeps[k]}) for k in weights]


def test_jobs_start_only_where_their_expected_memory_fits():
    weights = {"b1": 8, "b2": 8, "b3": 7, **{f"s{i}": 1 for i in range(6)}}
    sleeps = {k: (0.2 if k.startswith("b") else 0.05) for k in weights}
    slots = plan_slots(3, "cuda", tokens=["0"], cpu_count=12)
    pool = WorkerPool(slots, timeout=60, command=CHILD, weigh=lambda k: weights[k] * GIB, capacity=10 * GIB)
    seen = pool_view(pool, weighed(weights, sleeps))
    assert sorted(k for e, k in seen if e == "end") == sorted(weights)  # every job ran once
    assert all(total <= 10 for total, _ in running_weights(seen, weights))
    assert pool.waited > 0

    # negative control: the same jobs with no admission: the three large ones are handed out together
    seen = pool_view(WorkerPool(slots, timeout=60, command=CHILD), weighed(weights, sleeps))
    assert seen[:3] == [("start", "b1"), ("start", "b2"), ("start", "b3")]
    assert max(total for total, _ in running_weights(seen, weights)) > 10


def test_jobs_keep_their_order_and_a_job_larger_than_the_gpu_runs_alone():
    # b2 cannot start beside b1; the small ones behind it would fit beside b1 but wait their turn (the order is the
    # schedule's: most expensive first), so b2 is not starved; huge (over the capacity) runs with nothing else
    weights = {"b1": 8, "b2": 8, "s0": 1, "s1": 1, "s2": 1, "huge": 30, "s3": 1}
    sleeps = {k: 0.05 for k in weights}
    slots = plan_slots(3, "cuda", tokens=["0"], cpu_count=12)
    pool = WorkerPool(slots, timeout=60, command=CHILD, weigh=lambda k: weights[k] * GIB, capacity=10 * GIB)
    seen = pool_view(pool, weighed(weights, sleeps))
    assert sorted(k for e, k in seen if e == "end") == sorted(weights)
    starts = [k for e, k in seen if e == "start"]
    assert starts[:2] == ["b1", "b2"]  # b2 went before the smaller jobs read after it
    assert seen.index(("start", "b2")) > seen.index(("end", "b1"))  # and not beside b1
    for total, n in running_weights(seen, weights):
        assert total <= 10 or n == 1  # over the capacity only alone
    assert any(n >= 2 for _, n in running_weights(seen, weights))  # negative control: some jobs did share


def test_without_weights_nothing_waits():
    weights = {"b1": 8, "b2": 8}
    pool = WorkerPool(plan_slots(2, "cuda", tokens=["0"], cpu_count=8), timeout=60, command=CHILD,
                      weigh=lambda k: 0, capacity=10 * GIB)
    seen = pool_view(pool, weighed(weights, {"b1": 0.05, "b2": 0.05}))
    assert pool.waited == 0
    assert seen[:2] == [("start", "b1"), ("start", "b2")]


def test_a_job_that_fits_no_room_on_one_gpu_starts_on_another():
    weights = {"b1": 8, "b2": 8, "b3": 8, "s": 1}
    slots = plan_slots(4, "cuda", tokens=["0", "1"], cpu_count=16)  # two workers on each GPU
    pool = WorkerPool(slots, timeout=60, command=CHILD, weigh=lambda k: weights[k] * GIB, capacity=10 * GIB)
    seen, devices = [], {}

    def started(key, slot):
        seen.append(("start", key))
        devices[key] = slot.device
    try:
        for done in pool.run(weighed(weights, {"b1": 0.3, "b2": 0.3, "b3": 0.05, "s": 0.05}), on_start=started):
            seen.append(("end", done.key))
    finally:
        pool.close()
    assert seen[:2] == [("start", "b1"), ("start", "b2")] and devices["b1"] != devices["b2"]  # one on each GPU
    assert sorted(k for e, k in seen if e == "end") == sorted(weights)
    for device in ("cuda:0", "cuda:1"):  # no GPU ever held more than its capacity (or one job alone)
        on = [(e, k) for e, k in seen if devices[k] == device]
        assert all(total <= 10 or n == 1 for total, n in running_weights(on, weights))


def test_a_job_heavier_than_the_gpu_lends_runs_alone_once_in_a_fresh_child(tmp_path):
    """A job whose expected peak exceeds what its GPU lends its workers runs alone from the start: the device's idle
    children stopped, a fresh child, one run (no shared first attempt, no re-run); its implementation running out of
    memory there means it does not fit the GPU (``unsupported``, rule ``device-memory``). Control: the same job
    weighed within the capacity shares first, runs out of memory, and is re-run alone — two runs."""
    impl = {"failed_at": {"stage": "megatron run", "implementation_run": True}}
    slots = plan_slots(2, "cuda", tokens=["0"], cpu_count=8)
    weights = {"a": 1, "huge": 30, "b": 1}
    items = oom_jobs(tmp_path, ("a", "pass", 0.05), ("huge", "oom_alone", 0.0, impl), ("b", "pass", 0.0))
    started = []
    pool = WorkerPool(slots, timeout=30, command=CHILD, weigh=lambda k: weights[k] * GIB, capacity=10 * GIB)
    done = {f.key: f for f in run_list(pool, items, started)}
    assert sorted(done) == ["a", "b", "huge"]
    row = done["huge"].rows[0]
    assert (row["outcome"], row["decided_by"]) == ("unsupported", "device-memory")
    assert row["retried"] == "expected to need more than the 10 GiB cuda:0 lends its 2 workers; run alone"
    log = events(tmp_path)
    runs = [e for e in log if e[1] == "huge"]
    assert [e[0] for e in runs] == ["start", "end"]  # one run
    assert runs[0][2] not in {e[2] for e in log[:log.index(runs[0])]}  # in a child that had run nothing before
    at_huge = next(alive for key, _, alive in started if key == "huge")
    assert at_huge == [False, False]  # the device's idle children were stopped first
    start, end = log.index(runs[0]), log.index(runs[1])
    assert [e for e in log[start + 1:end] if e[3] == "0"] == []  # nothing else ran on the GPU meanwhile

    # control: weighed within the capacity, it shares first and is re-run alone after running out of memory
    (tmp_path / "c").mkdir()
    weights["huge"] = 5
    items = oom_jobs(tmp_path / "c", ("a", "pass", 0.05), ("huge", "oom_alone", 0.0, impl), ("b", "pass", 0.0))
    pool = WorkerPool(slots, timeout=30, command=CHILD, weigh=lambda k: weights[k] * GIB, capacity=10 * GIB)
    done = {f.key: f for f in run_list(pool, items)}
    assert done["huge"].rows[0]["retried"] == ("out of memory while sharing cuda:0 with 2 workers; re-run alone; out "
                                               "of memory again beside the idle workers: re-run with them stopped")
    assert [e[0] for e in events(tmp_path / "c") if e[1] == "huge"] == ["start", "end"] * 3


def test_backfill_runs_small_jobs_beside_a_waiting_large_one_and_never_delays_it():
    """With ``backfill``, the jobs behind a large job that cannot start yet (b2: 9 of 10 GiB beside b1's 5) run in the
    room it cannot use, each only where it fits (m6: 6 beside b1's 5 does not; the job heavier than the GPU behind b2 never
    backfills); once b1 has ended, none starts before b2, though small ones would still fit beside the ones running
    (b2 waits only for those). Control: without backfill the small jobs wait behind b2 (head-of-line)."""
    # 40 small jobs of 0.1 s on 5 workers outlast b1 (0.3 s) whatever the load: some are left when b2 may start
    weights = {"b1": 5, "b2": 9, "m6": 6, "huge": 30, **{f"s{i}": 1 for i in range(40)}}
    sleeps = {"b1": 0.3, "b2": 0.05, "m6": 0.05, "huge": 0.05, **{f"s{i}": 0.1 for i in range(40)}}
    order = ["b1", "b2", "m6", "huge", *[f"s{i}" for i in range(40)]]
    slots = plan_slots(6, "cuda", tokens=["0"], cpu_count=24)
    items = [(k, {"id": k, "do": "pass", "sleep": sleeps[k]}) for k in order]

    pool = WorkerPool(slots, timeout=60, command=CHILD, weigh=lambda k: weights[k] * GIB, capacity=10 * GIB,
                      backfill=64)
    seen = pool_view(pool, items)
    assert sorted(k for e, k in seen if e == "end") == sorted(weights)  # every job ran once
    assert all(total <= 10 or n == 1 for total, n in running_weights(seen, weights))  # over the capacity only alone
    assert seen[0] == ("start", "b1") and pool.backfilled > 0
    assert seen.index(("start", "s0")) < seen.index(("start", "b2"))  # a small job went past the waiting b2
    assert seen.index(("start", "m6")) > seen.index(("end", "b1"))  # 6 beside b1's 5: no room
    between = seen[seen.index(("end", "b1")):seen.index(("start", "b2"))]
    assert [k for e, k in between if e == "start"] == []  # b1 gone: nothing more jumps ahead of b2
    assert any(k.startswith("s") for e, k in seen[seen.index(("start", "b2")):] if e == "start")  # some were left

    control = WorkerPool(slots, timeout=60, command=CHILD, weigh=lambda k: weights[k] * GIB, capacity=10 * GIB)
    seen = pool_view(control, items)
    assert [k for e, k in seen if e == "start"][:2] == ["b1", "b2"] and control.backfilled == 0


def test_a_stop_starts_no_further_job_read_ahead_or_not():
    """``stop()`` (a spent time budget) starts nothing more, the jobs read ahead for backfill included: the caller's
    record of what started (``on_start``) is what ran, so it can list the rest as not run."""
    weights = {"b1": 8, "b2": 8, **{f"s{i}": 1 for i in range(6)}}
    sleeps = {"b1": 0.4, "b2": 0.05, **{f"s{i}": 0.05 for i in range(6)}}
    slots = plan_slots(3, "cuda", tokens=["0"], cpu_count=12)
    pool = WorkerPool(slots, timeout=60, command=CHILD, weigh=lambda k: weights[k] * GIB, capacity=10 * GIB,
                      backfill=16)
    started = []
    try:
        done = [f.key for f in pool.run(weighed(weights, sleeps), on_start=lambda k, _: started.append(k),
                                        stop=lambda: len(started) >= 3)]
    finally:
        pool.close()
    assert len(started) == 3 and sorted(done) == sorted(started)  # what started ran; nothing else did
    assert started[0] == "b1" and "b2" not in started  # b2 waited, two small ones backfilled, then the stop


def test_a_stop_drops_a_run_alone_that_has_not_started(tmp_path):
    """A job heavier than the GPU lends waits as a run alone for its device to go idle; a stop meanwhile (the budget)
    drops it like any job not started, while a re-run alone of a job that already ran still runs."""
    weights = {"a": 5, "huge": 30}
    slots = plan_slots(2, "cuda", tokens=["0"], cpu_count=8)
    pool = WorkerPool(slots, timeout=60, command=CHILD, weigh=lambda k: weights[k] * GIB, capacity=10 * GIB)
    started, t0 = [], time.monotonic()
    try:  # the stop comes while "a" runs (2 s), after "huge" became a run alone waiting for the GPU to go idle
        done = [f.key for f in pool.run([("a", {"id": "a", "do": "pass", "sleep": 2.0}),
                                          ("huge", {"id": "huge", "do": "pass", "sleep": 0.0})],
                                         on_start=lambda k, _: started.append(k),
                                         stop=lambda: "a" in started and time.monotonic() - t0 > 0.5)]
    finally:
        pool.close()
    assert started == ["a"] and done == ["a"]
    # control: no stop, the run alone runs
    pool = WorkerPool(slots, timeout=60, command=CHILD, weigh=lambda k: weights[k] * GIB, capacity=10 * GIB)
    assert sorted(f.key for f in run_list(pool, [("a", {"id": "a", "do": "pass", "sleep": 0.1}),
                                                 ("huge", {"id": "huge", "do": "pass", "sleep": 0.0})])) == ["a", "huge"]


def test_a_job_that_fits_another_idle_gpu_neither_waits_nor_lets_a_later_one_jump_it():
    """Two GPUs: the waiting job fits the second GPU's idle worker in the same pass, so it is not counted as waiting
    and backfill starts no later job ahead of it on the first (found by review: ``waited`` 1, ``s`` first).
    Control: on one GPU the same job does wait, and backfill runs ``s`` beside the large job."""
    weights = {"b1": 8, "e1": 1, "h": 5, "s": 1}
    sleeps = {"b1": 0.6, "e1": 0.6, "h": 0.05, "s": 0.05}

    def order(tokens, workers):
        slots = plan_slots(workers, "cuda", tokens=tokens, cpu_count=16)
        pool = WorkerPool(slots, timeout=30, command=CHILD, weigh=lambda k: weights[k] * GIB, capacity=10 * GIB,
                          backfill=8)
        started = []
        try:
            list(pool.run([(k, {"id": k, "do": "pass", "sleep": sleeps[k]}) for k in weights],
                          on_start=lambda k, s: started.append(k)))
        finally:
            pool.close()
        return started, pool.waited, pool.backfilled

    # w0 cuda:0 b1, w1 cuda:1 e1, then h fits cuda:1 (1 + 5 <= 10) though not cuda:0 (8 + 5)
    assert order(["0", "1"], 4) == (["b1", "e1", "h", "s"], 0, 0)
    assert order(["0"], 3) == (["b1", "e1", "s", "h"], 1, 1)


def test_a_job_heavier_than_the_gpu_lends_runs_alone_on_an_idle_gpu_not_a_busy_one():
    """Two GPUs of two workers: ``huge`` (over what a GPU lends) is asked for by cuda:0's idle worker while cuda:0
    runs ``long``; it runs alone on cuda:1, which runs nothing, instead of waiting for ``long`` to end (found by
    review: it started after ``long``). Control: with one GPU it can only wait for ``long``."""
    weights = {"long": 1, "first": 1, "huge": 30, "s1": 1}
    sleeps = {"long": 3.0, "first": 0.0, "huge": 0.05, "s1": 0.05}  # long: cuda:1 frees long before it ends

    def run(tokens):
        slots = plan_slots(len(tokens) * 2, "cuda", tokens=tokens, cpu_count=16)
        pool = WorkerPool(slots, timeout=30, command=CHILD, weigh=lambda k: weights[k] * GIB, capacity=10 * GIB)
        log = []
        try:
            for f in pool.run([(k, {"id": k, "do": "pass", "sleep": sleeps[k]}) for k in weights],
                              on_start=lambda k, s: log.append(("start", k, s.device))):
                log.append(("end", f.key, f.slot.device))
        finally:
            pool.close()
        return log

    log = run(["0", "1"])
    start = next(e for e in log if e[:2] == ("start", "huge"))
    assert start[2] == "cuda:1" and log.index(start) < log.index(("end", "long", "cuda:0"))
    single = run(["0"])
    assert single.index(("end", "long", "cuda:0")) < single.index(("start", "huge", "cuda:0"))
