"""Whose code an exception of a backward pass came from, when its traceback cannot say.

An error raised inside a C++ autograd node (``GatherBackward0``'s scatter, a CUDA kernel's check) carries no frame of
the code that built that node: its traceback ends at the harness's ``torch.autograd.grad`` call
(``parity/judge/snapshot.py``). :func:`locate` re-runs the implementation's forward under autograd's anomaly mode (every
graph node then keeps the traceback of the forward call that created it, ``node.metadata["traceback_"]``), hooks
every node of the graph (a pre-hook marks it started, a post-hook finished), runs the backward again and reads the
forward traceback of the node that started and never finished: the failing one. The answer is the innermost frame of
that traceback outside torch and the installed packages — the implementation's own call site
(``dir/file.py:function:line``), with the node's name.

Used by the engine only after an ``impl``-stage error whose traceback ends in the harness's backward call (an error
of Python backward code already names its frame; out-of-memory errors are not re-run). The re-run costs one more
forward and backward of the case; anomaly mode changes no value (``check_nan=False``: it only records tracebacks).
"""

from __future__ import annotations

import dataclasses
import re
import traceback
import warnings
from typing import Callable, ContextManager, Optional

import torch

from cases.case import Case
from cases.tensors import CaseTensors

from parity.judge.snapshot import INPUT_ORDER, _call, _leaf
from parity.run.out_of_memory import says_out_of_memory

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')
#: the harness's own backward call: where a C++ backward error's traceback ends
_BACKWARD_CALL = "_engine_run_backward"


def is_foreign(filename: str) -> bool:
    """A frame of torch itself or of an installed package (not the code under test)."""
    return "/site-packages/" in filename or "/torch/" in filename or filename.startswith("<")


def short(filename: str, function: str, line: int | str) -> str:
    """``dir/file.py:function:line``."""
    return "/".join(filename.split("/")[-2:]) + f":{function}:{line}"


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the device ran out of memory: a condition of the machine and of what shares it, never the
    code under test's behaviour on the case."""
    return isinstance(exc, torch.OutOfMemoryError) or says_out_of_memory(str(exc))


def raised_in_backward_without_frame(exc: BaseException) -> bool:
    """The exception came out of an autograd backward and no frame of the code under test lies past the harness's
    backward call (a C++ node raised it). Out-of-memory errors are excluded (a re-run would only run out again)."""
    if out_of_memory(exc):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    names = [f.name for f in frames]
    if _BACKWARD_CALL not in names:
        return False
    after = frames[len(names) - names[::-1].index(_BACKWARD_CALL):]
    return all(is_foreign(f.filename) for f in after)


def innermost_own_frame(stack: list[str]) -> Optional[str]:
    """The innermost frame of a formatted forward traceback (``traceback.format_stack()`` lines) that is not
    :func:`is_foreign`, as :func:`short`; None if there is none."""
    frames = [m for m in _FRAME.finditer("".join(stack))]
    for match in reversed(frames):
        if not is_foreign(match["file"]):
            return short(match["file"], match["name"], match["line"])
    return None


def _graph(root) -> list:
    seen, order, todo = set(), [], [root]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        order.append(node)
        todo.extend(fn for fn, _ in node.next_functions)
    return order


def failing_node(objective: torch.Tensor, leaves: list[torch.Tensor]) -> Optional[tuple[object, BaseException]]:
    """Run ``torch.autograd.grad(objective, leaves)`` with every node of its graph hooked; ``(node, exception)`` for
    the node whose backward raised, None if the backward ran through."""
    started: dict[int, object] = {}
    handles = []
    for node in _graph(objective.grad_fn):
        def pre(_grads, node=node):
            started[id(node)] = node

        def post(_inputs, _outputs, node=node):
            started.pop(id(node), None)

        handles += [node.register_prehook(pre), node.register_hook(post)]
    try:
        torch.autograd.grad(objective, leaves, allow_unused=True)
    except Exception as exc:  # noqa: BLE001 — the failure is what is being located
        return (next(iter(started.values())), exc) if started else None
    finally:
        for handle in handles:
            handle.remove()
    return None


def locate(module, case: Case, tensors: CaseTensors, *,
           context: Callable[[], ContextManager], with_loss: bool = True) -> Optional[str]:
    """``"dir/file.py:function:line (NodeName)"``: the forward call whose backward node raises when
    ``module`` runs ``case`` on ``tensors`` (as :func:`parity.judge.snapshot.take_snapshot` runs it, in the case dtype);
    None when the re-run does not raise in a backward node or the node's traceback has no frame of the code under
    test."""
    inputs = {n: _leaf(t, None) for n, t in tensors.inputs.items()}
    params = {n: _leaf(t, None) for n, t in tensors.params.items()}
    psp = tensors.packed_seq_params
    if psp is not None:
        psp = dataclasses.replace(psp, cu_seqlens_q=psp.cu_seqlens_q.clone(),
                                  cu_seqlens_q_padded=psp.cu_seqlens_q_padded.clone())
    leaves = [inputs[n] for n in INPUT_ORDER if n in inputs] + list(params.values())
    with context(), torch.autograd.set_detect_anomaly(True, check_nan=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode's own notices (its traceback is read from the node)
        result = _call(module, case, inputs, params, psp, None)
        objective = (result if with_loss else dataclasses.replace(result, indexer_loss=None)).objective(
            tensors.grad_output.clone())
        if not objective.requires_grad:
            return None
        found = failing_node(objective, leaves)
    if found is None:
        return None
    node, _exc = found
    frame = innermost_own_frame(list(node.metadata.get("traceback_") or []))
    return None if frame is None else f"{frame} ({node.name()})"
