"""A stand-in for ``python -m parity.worker`` (no torch, starts in milliseconds) for WorkerPool tests.

Speaks the worker protocol; each request ``{"id": ..., "do": ...}`` says what to do: ``pass`` / ``error`` (answer
that outcome), ``crash`` (``os._exit(3)``), ``hang`` (sleep past any test timeout), ``garbage`` (a torn protocol
line), ``noise`` (a stray stdout line before the answer). The answer's case row carries the child's pid and the
environment variables a slot sets, so a test can see which process ran what and how it was pinned.
"""

import json
import os
import sys
import time

MARK = "@@dsv4-parity@@ "

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
    if what == "noise":
        print("a library printed this", flush=True)
    time.sleep(request.get("sleep", 0.0))
    row = {"type": "case", "case_id": request["id"], "outcome": "error" if what == "error" else "pass",
           "pid": os.getpid(),
           "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "DSV4_PARITY_THREADS", "OMP_NUM_THREADS")}}
    sys.stdout.write(MARK + json.dumps([row]) + "\n")
    sys.stdout.flush()
