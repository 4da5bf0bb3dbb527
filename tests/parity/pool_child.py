"""A stand-in for ``python -m parity.run.worker`` (no torch, starts in milliseconds) for WorkerPool tests.

Speaks the worker protocol; each request ``{"id": ..., "do": ...}`` says what to do: ``pass`` / ``error`` (answer
that outcome), ``crash`` (``os._exit(3)``), ``hang`` (sleep past any test timeout), ``garbage`` (a torn protocol
line), ``noise`` (a stray stdout line in the same write as the answer), ``split`` (the answer in two writes),
``oom`` (an ``error`` row with torch's real out-of-memory message, as the engine words it), ``oom_once`` (``oom``
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
#: torch 2.11.0+cu130 on an H200, ``torch.empty(1 << 45, dtype=torch.uint8, device="cuda")`` (``str`` of the
#: ``torch.OutOfMemoryError``), worded as parity.engine reports an exception of the ``impl`` stage
OOM = ("impl: OutOfMemoryError: CUDA out of memory. Tried to allocate 32768.00 GiB. GPU 0 has a total capacity of "
       "139.80 GiB of which 139.29 GiB is free. Including non-PyTorch memory, this process has 518.00 MiB memory in "
       "use. Of the allocated memory 0 bytes is allocated by PyTorch, and 0 bytes is reserved by PyTorch but "
       "unallocated. If reserved but unallocated memory is large try setting "
       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation. See documentation for Memory "
       "Management (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-"
       "alloc-conf) [fused/attention.py:120]")


def log(request, event):
    if request.get("log"):
        line = f"{event} {request['id']} {os.getpid()} {os.environ.get('CUDA_VISIBLE_DEVICES')}\n".encode()
        fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

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
    row = {"type": "case", "case_id": request["id"], "outcome": "error" if what in ("error", "oom") else "pass",
           "message": OOM if what == "oom" else "planted error" if what == "error" else "", "pid": os.getpid(),
           "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "DSV4_PARITY_THREADS", "OMP_NUM_THREADS")}}
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
