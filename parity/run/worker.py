"""Case isolation: cases run in child processes so that a crash or a sticky CUDA error fails one case only.

The child (``python -m parity.run.worker``) reads one request per line on stdin, ``{"case": {...}, "options": {...},
"oracle": null | name}``, runs it with :func:`parity.run.execution.execute` and answers one line on its protocol channel:
``@@dsv4-parity@@ <JSON list of result rows>``. Anything the libraries print goes to stderr (fd 1 is redirected),
so the channel stays clean. ``DSV4_PARITY_THREADS`` in its environment sets its intra-op thread count.

:class:`WorkerPool` keeps one child per :class:`parity.run.placement.Slot` (a device and an environment: the slot's
``CUDA_VISIBLE_DEVICES`` pin and thread counts). :meth:`WorkerPool.run` hands the jobs out in the given order, each
to the next idle slot, and yields every job as it finishes — so a parent writing them as they come keeps all
finished cases when it is killed. Each job gets ``timeout`` seconds; a dead or hung child becomes that job's
``error`` (with the tail of the child's stderr) and the slot's next job starts a fresh child. With ``fresh=True``
every case gets a new child; otherwise a child is reused until a case ends in ``error`` (the CUDA context may be
poisoned) — so a sticky fault still costs exactly one case, without paying process start-up and kernel JIT per
case. On Linux a child dies with its parent (``PR_SET_PDEATHSIG``): a run killed by a CI time limit leaves no
worker busy on a GPU.

Several slots may share one device (``--workers auto`` puts up to 6 on a GPU). A job whose answer is an ``error``
case row that says the GPU ran out of memory (:func:`is_out_of_memory`), from a worker whose device label is shared
with other workers of the pool, is not yielded: it is re-run once *alone on that device* — unless torch's message
shows that the case needs more memory than the whole GPU (what it held plus what it asked for, over the total
capacity: :func:`parity.run.out_of_memory.beyond_device`); such a row is yielded at once, its message saying so
(a re-run alone would run out again, and it would hold the device's other workers back). As soon as such a retry is
pending, no new job goes to that device; when none of its workers is busy any more, the job runs again on one of
them, and the device's other workers wait until it ends. Their idle children stay up: each gave its cached blocks
back after its last case, so it holds its CUDA context and what it keeps between cases (about a GiB or two), and
stopping it would cost a process start, torch and every kernel loaded again, for each worker after each re-run (32
processes for 6 workers on an H100 gate of 2026-12-07 with six re-runs). Only where that re-run runs out of memory
too does the device's every idle child stop, and the job runs a third time, alone on the GPU in a fresh child (a
*strict* re-run; an idle child keeps its CUDA context, loaded kernels and whatever it holds between cases). Its
answer is yielded whatever its outcome, the case row carrying the additive field ``retried: "out of memory while
sharing <device> with <k> workers; re-run alone"`` (``k``: the pool's workers on that device; after a strict re-run
``…; re-run alone; out of memory again beside the idle workers: re-run with them stopped``); where the
implementation's own run (the row's ``failed_at``) ran out of memory in the strict re-run, within 10 % of the GPU's
capacity by torch's numbers and with no other process named as holding memory
(:func:`parity.run.out_of_memory.plausible_need`), the case does not fit that GPU and the row becomes ``unsupported``
(rule ``device-memory``), as it does on a GPU with one worker. Other devices keep taking jobs meanwhile. A retried job was already handed out, so it is
not read again from ``jobs``: a time budget that stops ``jobs`` does not stop a pending retry. With one worker per
device nothing is retried. Under memory admission (:class:`WorkerPool`) a job whose expected peak exceeds what its
device lends its workers takes that path from the start: it runs alone in a fresh child, the idle children stopped,
its row's ``retried`` saying why (``expected to need more than the N GiB <device> lends its k workers; run alone``),
and an out-of-memory answer is that of a run alone (no doomed first attempt beside the other children's CUDA
contexts, then a re-run: nine production cases on an 80 GB H100 ran twice that way on 2026-12-06).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from parity.run.out_of_memory import beyond_device, does_not_fit, first_failure, plausible_need, says_out_of_memory

MARK = "@@dsv4-parity@@ "
REPO = Path(__file__).resolve().parents[2]
THREADS_ENV = "DSV4_PARITY_THREADS"
PARENT_ENV = "DSV4_PARITY_PARENT"
#: what a child prepares before its first request (:func:`warm_up`): ``{"impl", "against", "provider", "device"}``
WARM_ENV = "DSV4_PARITY_WARM"


def _cache_dir(name: str) -> Callable[[dict], str]:
    """The directory :func:`fused.kernels.compile_cache.configure_environment` gives a library's compile cache in a
    process with environment ``env``: ``<DSV4_PARITY_CACHE_DIR or ~/.cache/dsv4-parity>/<name>``."""
    def value(env: dict) -> str:
        root = env.get("DSV4_PARITY_CACHE_DIR") or str(Path(env.get("HOME") or Path.home()) / ".cache" / "dsv4-parity")
        return str(Path(root).expanduser() / name)

    return value


#: the compile caches' variables and their directories under the project's root
#: (:func:`fused.kernels.compile_cache.configure_environment`'s)
_COMPILE_CACHES = {"CUTE_DSL_CACHE_DIR": "cute-dsl", "CUDNN_FRONTEND_COMPILED_CACHE": "cudnn-frontend",
                   "TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}
COMPILE_CACHE_DIRS = tuple(_COMPILE_CACHES)
#: variables every worker child sets for itself when unset, to the value given here as a function of the rest of
#: its environment: the determinism settings of :func:`parity.engine.configure_torch`, torch's
#: ``CUDA_MODULE_LOADING`` (as CUDA starts) and the compile caches' directories
#: (:func:`fused.kernels.compile_cache.configure_environment`, before the CuTe DSL is imported). A parent that sets
#: one of them to that same value after starting a child changes nothing for that child (:func:`same_child`).
SELF_SET: dict[str, Callable[[dict], str]] = {
    "CUBLAS_WORKSPACE_CONFIG": lambda env: ":4096:8",
    "TORCHINDUCTOR_DETERMINISTIC": lambda env: "1",
    "CUDA_MODULE_LOADING": lambda env: "LAZY",
    **{variable: _cache_dir(name) for variable, name in _COMPILE_CACHES.items()},
}


def point_compile_caches(env=None) -> dict:
    """Set each of :data:`COMPILE_CACHE_DIRS` that ``env`` (default this process's environment) leaves unset to the
    project's directory, the value a child gives it itself (:data:`SELF_SET`); returns what it set. Torch-free.

    ``run`` calls it before torch loads (``cli.main``): otherwise the first import of ``torch._dynamo`` (Megatron's
    layer modules import it, through ``torch.compile``) sets ``TORCHINDUCTOR_CACHE_DIR`` to torch's default,
    ``/tmp/torchinductor_<user>``, in the parent, which then starts its children with another inductor cache than
    the ones started early (never adopted: the 2026-12-08 H100 production gate took 0 of 6) and than its own
    fused-path children."""
    env = os.environ if env is None else env
    unset = {k: SELF_SET[k](dict(env)) for k in COMPILE_CACHE_DIRS if not env.get(k)}
    env.update(unset)
    return unset


def child_command() -> list[str]:
    """The worker child's command line."""
    return [sys.executable, "-m", "parity.run.worker"]


def warm_spec(impl: str, against: str, provider: str, device: str) -> str:
    """The :data:`WARM_ENV` value of a run's children (one string: the children of one run share it)."""
    return json.dumps({"impl": impl, "against": against, "provider": provider, "device": device}, sort_keys=True)


def child_env(slot, warm: Optional[str] = None) -> dict:
    """The environment of a worker child for ``slot`` (its pinning and thread counts) started now: this process's,
    the slot's overrides, the parent's pid (:func:`_die_with_parent`), the repository on ``PYTHONPATH`` and what it
    prepares before its first request (``warm``, :func:`warm_spec`)."""
    env = dict(os.environ)
    env.update(getattr(slot, "env", None) or {})
    env[PARENT_ENV] = str(os.getpid())
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if warm is not None:
        env[WARM_ENV] = warm
    else:
        env.pop(WARM_ENV, None)
    return env


def same_child(started: tuple[Sequence[str], dict], wanted: tuple[Sequence[str], dict]) -> list[str]:
    """The variables (or ``command``) in which a child started with ``started = (command, env)`` differs from one
    started now with ``wanted``; empty when it is the same child. A :data:`SELF_SET` variable that ``wanted`` has
    and ``started`` lacks is no difference when ``wanted`` holds the value the child gives it itself."""
    if list(started[0]) != list(wanted[0]):
        return ["command"]
    old, new = started[1], wanted[1]

    def sets_itself(k: str) -> bool:
        return k in SELF_SET and k not in old and new.get(k) == SELF_SET[k](old)

    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and not sets_itself(k))


def children_for(slots: Sequence, warm: Optional[str] = None) -> list[tuple[list[str], dict]]:
    """``(command, env)`` of the child each of ``slots`` starts now (what :class:`WorkerPool` starts, what
    :mod:`parity.run.prestart` starts early and compares)."""
    return [(child_command(), child_env(slot, warm)) for slot in slots]


@dataclass
class Spawned:
    """A worker child started with ``command`` and ``env``; ``stderr`` is the file its stderr goes to."""

    command: list
    env: dict
    proc: subprocess.Popen
    stderr: Any

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def spawn(command: Sequence[str], env: dict) -> Spawned:
    """Start a worker child (stdin: requests, stdout: answers, stderr: a temporary file)."""
    stderr = tempfile.TemporaryFile()
    proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                            cwd=str(REPO), env=env)
    return Spawned(list(command), env, proc, stderr)


def _close_pipes(proc: subprocess.Popen) -> None:
    """Close the parent's ends of a child's request and answer pipes (it has exited)."""
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:
            pass


def _stop_spawned(child: Spawned) -> None:
    """End a child that never got a request: killed at once (nothing runs in it), its pipes and file closed."""
    if child.alive:
        child.proc.kill()
    child.proc.wait()
    _close_pipes(child.proc)
    child.stderr.close()


@dataclass
class Finished:
    """A job's end: ``rows`` (the child's answer) or ``None`` and ``why`` (crash, timeout); ``slot`` ran it.
    ``retried``: the note of a job re-run alone after running out of GPU memory on a shared device (else ``None``;
    also on ``rows[0]`` when there are rows)."""

    key: Any
    rows: Optional[list]
    why: str
    slot: Any
    retried: Optional[str] = None


def _note_beyond_device(row: dict) -> Optional[str]:
    """When the out-of-memory ``row`` shows that its case needs more than the whole GPU
    (:func:`parity.run.out_of_memory.beyond_device`), say so in its ``message`` (and ``first_failure.message``):
    a re-run alone would only run out again, so the pool makes none. Returns the sentence, else None."""
    first = first_failure(row)
    text = " ".join(t for t in (row.get("message"), first.get("message")) if isinstance(t, str))
    beyond = beyond_device(text)
    if beyond is not None:
        for holder in (row, first):
            if isinstance(holder.get("message"), str) and beyond not in holder["message"]:
                holder["message"] += f" [{beyond}; not re-run alone]"
    return beyond


def _alone_does_not_fit(row: dict) -> None:
    """A case re-run alone on its GPU whose implementation run ran out of memory again does not fit that GPU: its
    row becomes ``unsupported`` (rule ``device-memory``, the message of
    :func:`parity.run.out_of_memory.does_not_fit`, as when torch's numbers alone show it; torch's message kept in
    ``first_failure``). Out of memory in the harness's own phases, or a message without torch's numbers, stays an
    ``error``."""
    where = row.get("failed_at") if isinstance(row.get("failed_at"), dict) else {}
    if not (is_out_of_memory(row) and where.get("implementation_run")):
        return
    stage, text = str(where.get("stage")), first_failure(row).get("message") or row.get("message") or ""
    sentence = does_not_fit(stage, text) if plausible_need(text, alone=True) else None
    if sentence is not None:  # torch's message as the engine keeps it (no "<stage>: " before it)
        text = text[len(stage) + 2:] if text.startswith(stage + ": ") else text
        row.update(outcome="unsupported", decided_by="device-memory", message=sentence,
                   first_failure={"tensor": None, "rule": "device-memory", "message": text})


def is_out_of_memory(row: Any) -> bool:
    """Whether a case row is an ``error`` because the GPU ran out of memory (its ``message`` or
    ``first_failure.message`` :func:`says_out_of_memory`)."""
    if not isinstance(row, dict) or row.get("outcome") != "error":
        return False
    texts = (row.get("message"), first_failure(row).get("message"))
    return says_out_of_memory(" ".join(t for t in texts if isinstance(t, str)))


@dataclass
class _Job:
    """A job handed out: ``retried`` is the note of its re-run alone (``None`` on its first run)."""

    key: Any
    request: dict
    retried: Optional[str] = None
    device: Any = None  # the device label it ran out of memory on (a pending retry)
    weight: int = 0  # its expected peak GPU bytes (memory admission; 0 without it)
    backfilled: bool = False  # started past a waiting job, in room that job could not use (memory admission)
    waited: bool = False  # found no room when it was first weighed (counted once in WorkerPool.waited)
    first_run: bool = False  # a pending run alone that has not run before (a stop drops it, unlike a re-run)
    strict: bool = False  # a run alone with the device's idle children stopped, in a fresh child


class Worker:
    """One child process serving one slot; started lazily, replaced after a crash or an ``error`` answer."""

    def __init__(self, slot, command: Optional[Sequence[str]] = None, warm: Optional[str] = None,
                 spare: Optional[Spawned] = None):
        self.slot = slot
        self.command = list(command) if command else child_command()
        self.warm = warm  # what the child prepares before its first request (WARM_ENV)
        self.spare = spare  # a child started before the run for this slot (parity.run.prestart), taken first
        self.proc: Optional[subprocess.Popen] = None
        self.stderr = None
        self.pending = b""
        self.started = 0  # processes started for this slot (replacements included)
        self.adopted = 0  # of those, children started before the run (0 or 1)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """A new child for the slot: the one started before the run when it is still up (once), else a fresh one."""
        self.stop()
        spare, self.spare = self.spare, None
        if spare is not None and spare.alive:
            child = spare
            self.adopted += 1
        else:
            if spare is not None:  # it died waiting (nothing ran in it): a fresh child takes its place
                _stop_spawned(spare)
            child = spawn(self.command, child_env(self.slot, self.warm))
        self.proc, self.stderr = child.proc, child.stderr
        self.pending = b""  # answer bytes read so far (an answer may arrive in several reads)
        self.started += 1

    def stop(self) -> None:
        """End the child: EOF on its stdin (it exits after the current case), killed if it lingers."""
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self.proc.stdin.close()
                    self.proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    self.proc.kill()
                    self.proc.wait()
            _close_pipes(self.proc)
            self.proc = None
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
            self.proc.wait()
        self.stop()

    def stderr_tail(self, limit: int = 1500) -> str:
        if self.stderr is None:
            return ""
        self.stderr.seek(0, os.SEEK_END)
        size = self.stderr.tell()
        self.stderr.seek(max(0, size - limit))
        text = self.stderr.read().decode("utf-8", "replace")
        return " | ".join(line.strip() for line in text.strip().splitlines()[-8:])

    def send(self, request: dict) -> str:
        """Start the child if needed and send one request; ``""`` on success, else why it failed (child gone)."""
        if not self.alive:
            self.start()
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            why = f"worker died before the case (exit {self.proc.poll()}): {self.stderr_tail()}"
            self.kill()
            return why
        return ""

    def receive(self) -> Optional[tuple[Optional[list], str]]:
        """Read what is available once stdout is readable (never blocks): ``(rows, "")`` for a whole answer,
        ``(None, why)`` if the child died or garbled its answer (the caller kills it), ``None`` while the answer is
        incomplete. Stray lines that are not the protocol's are skipped."""
        chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
        if not chunk:  # EOF: the child is gone (a torn answer in ``pending`` changes nothing)
            try:
                code = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = "unknown: it closed its output"
            return None, f"worker crashed (exit code {code}): {self.stderr_tail()}"
        self.pending += chunk
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            text = line.decode("utf-8", "replace")
            if not text.startswith(MARK):
                continue
            try:
                return json.loads(text[len(MARK):]), ""
            except json.JSONDecodeError as exc:
                return None, f"worker sent an unreadable answer ({exc.msg}): {self.stderr_tail()}"
        return None


class WorkerPool:
    """Children for ``slots`` (see the module docstring); ``timeout`` seconds per case.

    **Memory admission** (``weigh`` and ``capacity``, both given): ``weigh(key)`` is a job's expected peak GPU
    memory in bytes (:func:`parity.run.memory.expected_gpu_bytes`), ``capacity`` the bytes one device lends its
    workers. A job starts on a device only if the weights of the jobs running there plus its own fit ``capacity``
    — or nothing runs there (a job heavier than the device lends runs alone, in a fresh child, as a re-run alone
    does: the module docstring; on a device that runs nothing where there is one). The jobs keep their order: when
    the next job (the *head*) fits no device yet (no idle worker's device has room for it), it waits, and the jobs
    behind it wait their turn — except, with ``backfill`` > 0, a later job that fits the room
    now while the head could not start there even if every backfilled job there were gone (it waits for the jobs
    that went before it, not for the backfilled ones): up to ``backfill`` jobs are read ahead for that. So the small
    cases run beside a large case that must run nearly alone, and never delay the next large one by more than their
    own short run (once the head would fit but for them, none starts). A job of weight 0 fits wherever the device is
    not over its capacity. Without ``weigh`` nothing waits. ``run``'s ``stop`` (a time budget) starts no further job,
    read ahead or not; the caller knows which started from ``on_start``."""

    def __init__(self, slots: Sequence = (None,), timeout: float = 1800.0, fresh: bool = False,
                 command: Optional[Sequence[str]] = None, weigh: Optional[Callable[[Any], int]] = None,
                 capacity: Optional[int] = None, backfill: int = 0, warm: Optional[str] = None,
                 spares: Optional[Sequence[Optional[Spawned]]] = None):
        spares = list(spares or [])
        spares += [None] * (len(slots) - len(spares))
        # command: the child (tests use a fake); spares: children started before the run, one per slot or None
        self.workers = [Worker(slot, command, warm, spare) for slot, spare in zip(slots, spares)]
        self.timeout = timeout
        self.fresh = fresh
        self.weigh = weigh if (weigh is not None and capacity) else None
        self.capacity = capacity
        self.waited = 0  # jobs that found no room when first weighed (memory admission)
        self.backfill = max(0, int(backfill)) if self.weigh is not None else 0
        self.backfilled = 0  # jobs started past a waiting one
        self._busy: dict[int, tuple[_Job, float, Any]] = {}  # worker index -> (job, deadline, registered pipe)

    @property
    def started(self) -> int:
        """Child processes started so far, replacements included."""
        return sum(w.started for w in self.workers)

    @property
    def adopted(self) -> int:
        """Of :attr:`started`, the children that were started before the run (:mod:`parity.run.prestart`)."""
        return sum(w.adopted for w in self.workers)

    def close(self) -> None:
        """Kill the children still running a case (an aborted run); stop the idle ones (EOF, in parallel)."""
        for i in list(self._busy):
            self.workers[i].kill()
        self._busy.clear()
        for w in self.workers:
            if w.alive:
                try:
                    w.proc.stdin.close()
                except OSError:
                    pass
        for w in self.workers:
            w.stop()
            if w.spare is not None:  # a child started before the run that no job needed
                _stop_spawned(w.spare)
                w.spare = None

    def run(self, jobs: Iterable[tuple[Any, dict]], on_start: Optional[Callable[[Any, Any], None]] = None,
            stop: Optional[Callable[[], bool]] = None) -> Iterator[Finished]:
        """Run ``(key, request)`` jobs, dispatched in order to idle slots; yield each :class:`Finished` as it
        ends (completion order), each job once. ``on_start(key, slot)`` is called as a job is handed out (again for
        a re-run alone after running out of GPU memory on a shared device: see the module docstring). ``jobs`` is
        read lazily, one job as a slot frees up, so a generator can stop handing out work (a run's time budget);
        a pending re-run is not read from ``jobs`` and so is not stopped by it. ``stop()`` true: no further job
        starts (jobs read ahead and not started are dropped), a pending re-run still runs."""
        queue = _Lookahead(jobs)
        busy = self._busy
        sel = selectors.DefaultSelector()
        labels = [getattr(w.slot, "device", None) for w in self.workers]
        sharing = {label: labels.count(label) for label in labels}  # device label -> workers of the pool on it
        retries: list[_Job] = []  # jobs that ran out of memory on a shared device, to re-run alone on it (FIFO)
        alone: dict[Any, int] = {}  # device label -> the worker running a retry alone on it
        pending: list[_Job] = []  # jobs read from ``jobs`` and not started: the waiting head, then read-ahead ones

        def stopped() -> bool:
            if stop is not None and stop():
                pending.clear()
                retries[:] = [job for job in retries if not job.first_run]  # never started: not run, as pending
                return True
            return False

        def more() -> bool:
            """Whether a new job may still start: not stopped, and one is pending or coming."""
            return not stopped() and (bool(pending) or bool(queue))

        def held(device, backfilled_only: bool = False) -> int:
            """The expected GPU bytes of the jobs running on ``device`` (only the backfilled ones)."""
            return sum(job.weight for j, (job, _, _) in busy.items()
                       if labels[j] == device and (job.backfilled or not backfilled_only))

        def fits(device, job: _Job) -> bool:
            """Whether ``job`` may start on ``device``: nothing runs there, or it fits beside what does."""
            if not any(labels[j] == device for j in busy):
                return True
            return held(device) + job.weight <= self.capacity

        def read() -> Optional[_Job]:
            """The next job from ``jobs``, weighed, or None when none is coming (read only now: a slot is idle)."""
            if not queue:
                return None
            key, request = queue.pop()
            return _Job(key, request, weight=max(0, int(self.weigh(key))))

        def backfills(device, job: _Job) -> bool:
            if job.weight <= self.capacity and fits(device, job):
                job.backfilled = True
                self.backfilled += 1
                return True
            return False

        def heavy(job: _Job, device) -> _Job:
            """``job`` (heavier than a device lends its workers) as a run alone on ``device``."""
            return _Job(job.key, job.request, f"expected to need more than the {self.capacity / 2**30:.0f} GiB "
                        f"{device} lends its {sharing[device]} workers; run alone", device, job.weight,
                        first_run=True, strict=True)

        def open_to(other) -> bool:
            """Whether an idle worker of device ``other`` may take a new job now (no run alone there, none due)."""
            return other not in alone and not any(job.device == other for job in retries)

        def free(other) -> bool:
            """Whether device ``other`` runs nothing and may take a job: a run alone starts there at once."""
            return open_to(other) and not any(labels[j] == other for j in busy)

        def admitted(device) -> Optional[_Job]:
            """The next job for ``device`` under memory admission (the class docstring), else None."""
            if not pending:
                job = read()
                if job is None:
                    return None
                pending.append(job)
            head = pending[0]
            if head.weight > self.capacity and sharing[device] > 1:
                # heavier than the device lends its workers: it would run only with nothing else there anyway, so
                # it runs alone from the start — the device's idle children stopped, in a fresh child — and its
                # answer is that of a run alone (no doomed first attempt beside their CUDA contexts, no re-run);
                # while this device is busy, a device that runs nothing takes it over (next_job)
                pending.pop(0)
                retries.append(heavy(head, device))
                return None
            if fits(device, head):
                return pending.pop(0)
            if any(j not in busy and labels[j] != device and open_to(labels[j]) and fits(labels[j], head)
                   for j in range(len(self.workers))):
                return None  # an idle worker of another device takes it in this pass: it waits for nothing
            if not head.waited:
                head.waited = True
                self.waited += 1
            if not self.backfill or held(device) - held(device, backfilled_only=True) + head.weight <= self.capacity:
                return None  # no read-ahead; or the head waits only for backfilled jobs here: it must not starve
            for i, job in enumerate(pending[1:], 1):
                if backfills(device, job):
                    return pending.pop(i)
            while len(pending) <= self.backfill:
                job = read()
                if job is None:
                    return None
                if backfills(device, job):
                    return job
                pending.append(job)
            return None

        def release(i: int) -> _Job:
            job, _, pipe = busy.pop(i)
            sel.unregister(pipe)  # before the child (and so the pipe) may be closed
            if alone.get(labels[i]) == i:
                del alone[labels[i]]
            return job

        def next_job(i: int) -> Optional[_Job]:
            """The job for idle worker ``i``, or ``None`` (nothing for it now)."""
            device = labels[i]
            halted = stopped()  # a stop drops the runs alone that never started, before one is picked
            if device in alone:
                return None  # its device is lent to a retry running alone
            retry = next((job for job in retries if job.device == device), None)
            if retry is None and sharing[device] > 1 and free(device):
                # a run alone from the start still waiting for its busy device: this device runs nothing, it takes it
                waiting = next((job for job in retries if job.first_run and job.weight > self.capacity
                                and any(labels[j] == job.device for j in busy)), None)
                if waiting is not None:
                    retry = heavy(waiting, device)
                    retries[retries.index(waiting)] = retry
            if retry is not None:  # no new job on this device until it has run
                if any(labels[j] == device for j in busy):
                    return None  # wait until the device is idle
                if not retry.strict and not self.workers[i].alive and any(
                        labels[j] == device and self.workers[j].alive for j in range(len(self.workers))):
                    return None  # an idle worker of the device whose child is up takes it: no process start
                retries.remove(retry)
                alone[device] = i
                for j, other in enumerate(self.workers):
                    if retry.strict and labels[j] == device and other.alive:  # its own child too: a fresh one
                        other.stop()  # an idle child still holds its CUDA context and what it keeps between cases
                return retry
            if halted:
                return None
            if self.weigh is not None:
                return admitted(device)
            if not queue:  # reads the next job from ``jobs`` (only now: a slot is idle)
                return None
            key, request = queue.pop()
            return _Job(key, request)

        try:
            while busy or more() or retries:  # busy first: the next job is read only when a slot is idle
                for i, w in enumerate(self.workers):
                    if i in busy:
                        continue
                    job = next_job(i)
                    if job is None:
                        continue
                    if on_start is not None:
                        on_start(job.key, w.slot)
                    why = w.send(job.request)
                    if why:
                        alone.pop(labels[i], None)
                        yield Finished(job.key, None, why, w.slot, job.retried)
                        continue
                    busy[i] = (job, time.monotonic() + self.timeout, w.proc.stdout)
                    sel.register(w.proc.stdout, selectors.EVENT_READ, i)
                if not busy:
                    continue
                wait = min(deadline for _, deadline, _ in busy.values()) - time.monotonic()
                for event, _ in sel.select(timeout=min(max(wait, 0.0), 5.0)):
                    i = event.data
                    w = self.workers[i]
                    answer = w.receive()
                    if answer is None:
                        continue
                    rows, why = answer
                    job = release(i)
                    if rows is None:
                        w.kill()
                    elif self.fresh or (rows and rows[0].get("outcome") == "error"):
                        w.stop()  # a poisoned CUDA context must not run the next case
                    device = labels[i]
                    shared = job.retried is None and sharing[device] > 1  # it ran beside other workers
                    # or it was a re-run alone beside the device's idle children: the next one runs without them
                    again = rows and (shared or (job.retried is not None and not job.strict)) \
                        and is_out_of_memory(rows[0])
                    # (the note "not re-run alone" only where a re-run alone was in question)
                    if again and _note_beyond_device(rows[0]) is None:
                        if shared:
                            note = f"out of memory while sharing {device} with {sharing[device]} workers; re-run alone"
                        else:
                            note = f"{job.retried}; out of memory again beside the idle workers: re-run with them " \
                                   "stopped"
                        retries.append(_Job(job.key, job.request, note, device, job.weight, strict=not shared))
                        continue
                    if rows and job.retried is not None:
                        rows[0]["retried"] = job.retried
                    if rows and (job.strict or sharing[device] == 1):  # it had the GPU to itself
                        _alone_does_not_fit(rows[0])
                    yield Finished(job.key, rows, why, w.slot, job.retried)
                now = time.monotonic()
                for i in [i for i, (_, deadline, _) in busy.items() if deadline <= now]:
                    w = self.workers[i]
                    job = release(i)
                    why = f"timed out after {self.timeout:g} s (worker killed): {w.stderr_tail()}"
                    w.kill()
                    yield Finished(job.key, None, why, w.slot, job.retried)
        finally:
            sel.close()


class _Lookahead:
    """An iterator with ``bool()`` = "another item is coming" and ``pop()`` = take it; the underlying iterator is
    advanced only when asked, so a generator decides on its next item as late as possible."""

    _END, _UNREAD = object(), object()

    def __init__(self, items: Iterable):
        self._it = iter(items)
        self._next = self._UNREAD

    def __bool__(self) -> bool:
        if self._next is self._UNREAD:
            self._next = next(self._it, self._END)
        return self._next is not self._END

    def pop(self):
        if not self:
            raise IndexError("no job left")
        item, self._next = self._next, self._UNREAD
        return item


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies (a CI ``timeout`` or ``kill`` of the run must not leave workers
    holding GPUs). Elsewhere a no-op: the child then ends at its next read of the closed request pipe."""
    parent = os.environ.get(PARENT_ENV)
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent and str(os.getppid()) != parent:  # the parent died before prctl took effect
        os._exit(1)


def warm_up(spec: str) -> None:
    """Pay this process's one-time costs before its first request (``spec``: :func:`warm_spec`), so that they
    overlap the parent's own start (:mod:`parity.run.prestart`) instead of delaying the first case: the
    implementations and their kernel providers imported (each provider asked whether it runs here, which imports its
    libraries: cuDNN Frontend, FlashMLA, production's tree), ``torch._dynamo`` imported (``torch.utils.checkpoint``
    imports it on its first call: the reference's row blocks) and, on CUDA, the context made and the BLAS handle
    created (one small product). Nothing here changes a result: each step is one the first case takes anyway. A step
    that fails is left to the first case to report (one line on stderr here)."""
    import torch

    from parity.engine import one_line
    from parity.run.execution import load_impl

    try:
        wanted = json.loads(spec)
        for name in dict.fromkeys(n for n in (wanted.get("impl"), wanted.get("against")) if n):
            load_impl(name).providers()
        import torch._dynamo  # noqa: F401
        if wanted.get("device") == "cuda" and torch.cuda.is_available():
            block = torch.ones(64, 64, device="cuda")
            (block @ block).sum().item()
            del block
            torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001 — the first case meets the same problem and reports it
        print(f"warm-up: {one_line(exc)}", file=sys.stderr)


def main() -> int:
    _die_with_parent()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library prints go to stderr
    sys.stdout = sys.stderr
    import torch

    from parity.engine import configure_torch  # imported after the redirect: importing torch may print
    from parity.run.execution import execute

    configure_torch()
    if os.environ.get(THREADS_ENV):
        torch.set_num_threads(max(1, int(os.environ[THREADS_ENV])))
    if os.environ.get(WARM_ENV):
        warm_up(os.environ[WARM_ENV])

    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        rows = execute(request)
        proto.write(MARK + json.dumps(rows, separators=(",", ":"), allow_nan=False) + "\n")
        proto.flush()
        if torch.cuda.is_initialized():  # workers sharing a GPU: give the case's cached blocks back to the others
            torch.cuda.empty_cache()
    sys.stderr.flush()
    os._exit(0)  # EOF: nothing left to save; skipping interpreter teardown (torch, CUDA) frees the slot sooner


if __name__ == "__main__":
    sys.exit(main())
