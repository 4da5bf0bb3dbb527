"""A CPU-testable count of the host reads a piece of harness code makes (on CUDA each one is a device sync).

Counted: ``float()`` / ``int()`` / ``bool()`` / ``.item()`` / ``.tolist()`` / ``.numpy()`` of a tensor, ``.cpu()`` and
``.to("cpu")``, ``torch.equal``, ``nonzero`` / ``masked_select`` and boolean-mask indexing (their output size is only
known on the host). On a CPU these are free; on a GPU shared by several worker processes each one waits for the
device, which is why the harness reads its metrics back in one transfer (:func:`parity.judge.metrics.fetch`).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

_READS = {"__float__", "__int__", "__bool__", "__index__", "item", "tolist", "numpy", "cpu", "equal", "nonzero",
          "masked_select", "allclose"}


def _to_host(args, kwargs) -> bool:
    targets = list(args[1:]) + [kwargs.get("device")]
    return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets
               if t is not None and not isinstance(t, torch.dtype))


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads: ...``; ``reads.total`` and ``reads.by_op`` (a Counter) afterwards."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS or (name == "to" and _to_host(args, kwargs)) or (
                name == "__getitem__" and len(args) > 1 and isinstance(args[1], torch.Tensor)
                and args[1].dtype == torch.bool):
            self.by_op[name] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())
