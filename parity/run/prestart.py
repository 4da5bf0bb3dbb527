"""Worker children started before the parent has loaded torch or planned the run, so that their start overlaps it.

A GPU run's worker child pays several seconds before its first case can start: the interpreter, torch and the
harness imported, then (:func:`parity.run.worker.warm_up`) the kernel libraries, ``torch._dynamo`` and the CUDA
context. The parent pays seconds of its own before it hands out the first case: torch imported, the suite built,
the environment recorded. Started only once the run is planned, the children add their start to the parent's; on
the H100 of 2026-12-07 a warm PR gate spent about 11 s before its run's clock started and its six children about
6 s each after it (``reports/baselines/h100/bench/NOTE-20261207g.md``).

So ``dsv4-parity run`` (:func:`begin`, called by the command line before it loads torch) guesses the run's slots
from its arguments alone (:func:`planned_children`: the device from NVML, the worker count and each slot's pinning
and threads as :mod:`parity.run.placement` will plan them) and starts one child per slot at once. The runner then
hands each planned slot the child started for it (:meth:`Prestart.assign`), **only if that child is exactly what a
fresh one would be**: the same command and environment (:func:`parity.run.worker.same_child`); any other child is
stopped, and the slot starts a fresh one as before. A wrong guess therefore costs the children's CPU time and
never changes a run: its cases run in children that are indistinguishable from fresh ones.

Where nothing is started: ``--resume`` (the recorded run decides its options), a run of one worker (in this
process on a CPU; one unpinned child on a GPU whose thread count torch decides), ``--isolate none`` or ``case``,
and ``DSV4_PARITY_PRESTART=0`` (to measure the difference: ``.ci/gate-speed-ab.sh``). The run's end row counts the
children adopted this way (``occupancy.prestarted``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from typing import Optional, Sequence

from parity.run import placement
from parity.run.host import host_available_bytes
from parity.run.usage import parse_workers
from parity.run.worker import Spawned, _stop_spawned, children_for, same_child, spawn, warm_spec

SWITCH_ENV = "DSV4_PARITY_PRESTART"


def nvml_gpu_count() -> int:
    """The GPUs the NVIDIA driver lists (NVML, as ``nvidia-smi`` does; CUDA is not started), 0 without the driver."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    count = ctypes.c_uint(0)
    try:
        if nvml.nvmlInit_v2() != 0:
            return 0
        try:
            return int(count.value) if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else 0
        finally:
            nvml.nvmlShutdown()
    except AttributeError:
        return 0


def _selection_size(args: argparse.Namespace) -> Optional[int]:
    """How many cases the arguments select at most, where that is known without building them (else None)."""
    named = len(getattr(args, "case", None) or []) + len(getattr(args, "case_id", None) or [])
    sizes = [n for n in (named or None, getattr(args, "limit", None)) if n]
    return min(sizes) if sizes else None


def planned_children(args: argparse.Namespace, gpus: Optional[int] = None,
                     cpu_count: Optional[int] = None) -> list[tuple[list[str], dict]]:
    """``(command, env)`` of each worker child ``run`` with ``args`` will start, as far as the arguments and the
    driver tell before torch is loaded (``gpus``: the GPUs the driver lists, default :func:`nvml_gpu_count`); empty
    where nothing is started early (module docstring)."""
    if getattr(args, "command", None) != "run" or getattr(args, "resume", False):
        return []
    if os.environ.get(SWITCH_ENV, "1").strip().lower() in ("0", "off", "false", "no"):
        return []
    if getattr(args, "isolate", "auto") not in ("auto", "worker"):
        return []
    device = args.device
    if device != "cpu" and gpus is None:
        gpus = nvml_gpu_count()
    if device == "auto":
        device = "cuda" if gpus > 0 else "cpu"
    tokens = None
    if device == "cuda":
        tokens = placement.visible_cuda_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus)
        if not tokens:
            return []
    workers = parse_workers(getattr(args, "workers", None))
    cores = cpu_count or os.cpu_count() or 1
    if workers == "auto":
        workers = placement.auto_workers(device, len(tokens or []), cores)
    selected = _selection_size(args)
    if workers < 2 or (selected is not None and selected < 2):
        return []
    slots = placement.plan_slots(workers, device, threads=getattr(args, "threads", None), tokens=tokens,
                                 cpu_count=cores)
    slots = slots[:selected] if selected is not None else slots
    return children_for(slots, warm_spec(args.impl, args.against, args.provider, device))


class Prestart:
    """Children started before the run (one per guessed slot, in slot order), until :meth:`assign` hands them out.
    ``host_available``: the host's available memory just before they started (what the run's memory check weighs
    its cases against, as it would have without them: :func:`parity.run.memory.check_memory`)."""

    def __init__(self, children: Sequence[Spawned], host_available: Optional[int] = None):
        self.children: list[Spawned] = list(children)
        self.host_available = host_available

    @classmethod
    def spawn(cls, planned: Sequence[tuple[list[str], dict]]) -> "Prestart":
        """Start one child per ``(command, env)``; if one cannot start (or the start is interrupted), those already
        started are stopped before the error goes on."""
        early = cls([], host_available_bytes())
        try:
            for command, env in planned:
                early.children.append(spawn(command, env))
        except BaseException:
            early.close()
            raise
        return early

    def assign(self, wanted: Sequence[tuple[Sequence[str], dict]]) -> tuple[list[Optional[Spawned]], list[str]]:
        """For each ``(command, env)`` a fresh child of the run would start with (its slots in order), the child
        started early for it, or None where none is the same child (:func:`parity.run.worker.same_child`); every
        child not handed out is stopped now. Also returns what differed (variable names), for a note."""
        taken: list[Optional[Spawned]] = []
        differs: set[str] = set()
        left = list(self.children)
        for command, env in wanted:
            match = None
            for child in left:
                why = same_child((child.command, child.env), (command, env))
                if not why:
                    match = child
                    break
                differs.update(why)
            if match is not None:
                left.remove(match)
            taken.append(match)
        self.children = left
        self.close()
        return taken, sorted(differs) if any(t is None for t in taken) else []

    def close(self) -> None:
        """Stop every child not handed out."""
        for child in self.children:
            _stop_spawned(child)
        self.children = []


def begin(args: argparse.Namespace) -> Optional[Prestart]:
    """Start the children of ``run`` with ``args`` now (None where none is started: :func:`planned_children`)."""
    try:
        planned = planned_children(args)
        return Prestart.spawn(planned) if planned else None
    except Exception as exc:  # noqa: BLE001 — an early start is an optimisation: the run starts its children itself
        print(f"note: worker processes not started early: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
