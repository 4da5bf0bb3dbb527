"""Kernel providers of the fused path: the interface (:mod:`.base`), the argument contracts (:mod:`.contracts`) and
the ``torch`` provider (:mod:`.torch_provider`). GPU providers (``cudnn``, ``flashmla``) register in
:data:`fused.plan.PROVIDERS` and are imported only when a plan asks for them."""

from .base import STAGES, KernelSet, TupleDict

__all__ = ["STAGES", "KernelSet", "TupleDict"]
