"""A stand-in for ``python -m parity.worker`` (no torch, starts in milliseconds) for WorkerPool tests.

Speaks the worker protocol; each request ``{"id": ..., "do": ...}`` says what to do: ``pass`` / ``error`` (answer
that outcome), ``crash`` (``os._exit(3)``), ``hang`` (sleep past any test timeout), ``garbage`` (a torn protocol
line), ``noise`` (a stray stdout line in the same write as the answer), ``split`` (the answer in two writes).
The answer's case row carries the child's pid and the environment variables a slot sets, so a test can see which
process ran what and how it was pinned. Like the real worker it dies with its parent, unless
``POOL_CHILD_OUTLIVE_PARENT`` is set.
"""

import json
import os
import sys
import time

MARK = "@@dsv4-parity@@ "

if not os.environ.get("POOL_CHILD_OUTLIVE_PARENT"):  # the real worker's behaviour (negative control: set it)
    from parity.worker import _die_with_parent

    _die_with_parent()

for line in sys.stdin:
    request = json.loads(line)
    what = request["do"]
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
    row = {"type": "case", "case_id": request["id"], "outcome": "error" if what == "error" else "pass",
           "pid": os.getpid(),
           "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "DSV4_PARITY_THREADS", "OMP_NUM_THREADS")}}
    answer = MARK + json.dumps([row]) + "\n"
    if what == "noise":  # a stray line arriving in the same read as the answer
        answer = "a library printed this\n" + answer
    if what == "split":  # an answer arriving in two writes, the second one later
        sys.stdout.write(answer[:20])
        sys.stdout.flush()
        time.sleep(0.3)
        answer = answer[20:]
    sys.stdout.write(answer)
    sys.stdout.flush()
