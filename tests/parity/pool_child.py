"""A stand-in for ``python -m parity.run.worker`` (no torch, starts in milliseconds) for WorkerPool tests.

Speaks the worker protocol; each request ``{"id": ..., "do": ...}`` says what to do: ``pass`` / ``error`` (answer
that outcome), ``crash`` (``os._exit(3)``), ``hang`` (sleep past any test timeout), ``garbage`` (a torn protocol
line), ``noise`` (a stray stdout line in the same write as the answer), ``split`` (the answer in two writes),
``oom`` (an ``error`` row with torch's real out-of-memory message, as the engine words it, of a case that
fits the GPU alone), ``oom_beyond`` (the same of a case that needs more than the whole GPU), ``oom_once`` (``oom``
if the file ``flag`` does not exist yet, creating it; else what ``then`` says, default ``pass``). With ``log`` (a
path) the child appends ``start|end <id> <pid> <CUDA_VISIBLE_DEVICES>`` lines to it around the job (O_APPEND: one
line per write, in the order they happened), so a test can check what ran concurrently by order, not by time.
The answer's case row carries the child's pid and the environment variables a slot sets, so a test can see which
process ran what and how it was pinned. Like the real worker it dies with its parent, unless
``POOL_CHILD_OUTLIVE_PARENT`` is set.
"""

import json
import os
import sys
import time

MARK = "@@dsv4-parity@@ "
#: torch 2.11.0+cu130 on an H200 shared by six workers (gate case 773075c8f835, production's unfused path,
#: 2026-12-04, as far as the stored report kept it), worded as parity.engine reports an exception of the ``impl``
#: stage: the case needs ~10.9 GiB (5.92 held + 4.97 asked), so a re-run alone fits the 139.80 GiB GPU
OOM = ("impl: OutOfMemoryError: CUDA out of memory. Tried to allocate 4.97 GiB. GPU 0 has a total capacity of 139.80 "
       "GiB of which 4.41 GiB is free. Process 1707 has 69.27 GiB memory in use. Process 1702 has 55.21 GiB memory in "
       "use. Including non-PyTorch memory, this process has 5.92 GiB memory in use. Process 1704 has 2.99 GiB memory "
       "in use. [judge/snapshot.py:take_snapshot:142]")
#: verbatim, torch 2.11.0+cu130 on an H100 80GB (gate case 99b09d37c508, production's unfused path, 2026-12-06):
#: 62.16 GiB allocated by PyTorch + 19.61 GiB asked > the 79.18 GiB GPU — no re-run alone can fit it
OOM_BEYOND = (
    "megatron run: OutOfMemoryError: CUDA out of memory. Tried to allocate 19.61 GiB. GPU 0 has a total capacity of "
    "79.18 GiB of which 15.32 GiB is free. Including non-PyTorch memory, this process has 63.85 GiB memory in use. Of "
    "the allocated memory 62.16 GiB is allocated by PyTorch, and 1.02 GiB is reserved by PyTorch but unallocated. If "
    "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation. See documentation for Memory Management "
    "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf) "
    "[judge/snapshot.py:take_snapshot:142]")

#: torch 2.11.0+cu130 on an H100 80GB, gate case 1c5cbcb11f97 re-run alone (production's unfused path, 2026-12-06),
#: worded as parity.engine reports it: 59.22 GiB allocated + 18.83 asked = 78.05 GiB, under the 79.18 GiB card by
#: torch's lower bound (context and cached blocks made the rest), no other process on the GPU
OOM_ALONE = (
    "megatron run: OutOfMemoryError: CUDA out of memory. Tried to allocate 18.83 GiB. GPU 0 has a total capacity of "
    "79.18 GiB of which 18.31 GiB is free. Including non-PyTorch memory, this process has 60.86 GiB memory in use. Of "
    "the allocated memory 59.22 GiB is allocated by PyTorch, and 1005.22 MiB is reserved by PyTorch but unallocated. "
    "[judge/snapshot.py:take_snapshot:144]")


def log(request, event):
    if request.get("log"):
        line = f"{event} {request['id']} {os.getpid()} {os.environ.get('CUDA_VISIBLE_DEVICES')}\n".encode()
        fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def main() -> None:
    if not os.environ.get("POOL_CHILD_OUTLIVE_PARENT"):  # the real worker's behaviour (negative control: set it)
        from parity.run.worker import _die_with_parent

        _die_with_parent()

    for line in sys.stdin:
        request = json.loads(line)
        what = request["do"]
        log(request, "start")
        if what == "oom_once":
            flag = request["flag"]
            what = request.get("then", "pass") if os.path.exists(flag) else "oom"
            open(flag, "a").close()
        if what == "crash":
            print("planted crash", file=sys.stderr, flush=True)
            os._exit(3)
        if what == "hang":
            time.sleep(120)
        if what == "garbage":
            sys.stdout.write(MARK + "[{\"type\": \n")
            sys.stdout.flush()
            continue
        time.sleep(request.get("sleep", 0.0))
        message = {"oom": OOM, "oom_beyond": OOM_BEYOND, "oom_alone": OOM_ALONE, "error": "planted error"}.get(what, "")
        row = {"type": "case", "case_id": request["id"], "outcome": "error" if message else "pass",
               "message": message, "pid": os.getpid(),
               "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "DSV4_PARITY_THREADS", "OMP_NUM_THREADS")}}
        if message and request.get("failed_at"):  # where parity.engine says the case stopped
            row["failed_at"] = request["failed_at"]
        answer = MARK + json.dumps([row]) + "\n"
        if what == "noise":  # a stray line arriving in the same read as the answer
            answer = "a library printed this\n" + answer
        if what == "split":  # an answer arriving in two writes, the second one later
            sys.stdout.write(answer[:20])
            sys.stdout.flush()
            time.sleep(0.3)
            answer = answer[20:]
        log(request, "end")
        sys.stdout.write(answer)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
