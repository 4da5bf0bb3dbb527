"""The reference cuts its row blocks and packed segments with one ``split``, not a slice each.

A slice of a tensor that carries a gradient backs into a zero-filled copy of the whole tensor (``slice_backward``);
one slice per THD segment or per row block made the reference's backward zero-fill and add up the packed query,
KV, hidden and latent once per segment and block (on a 4k-row gate case on the H100: ~1,100 fills, the largest
fill kernels of its reference run). ``thd.segment_rows`` and ``numerics.row_blocks`` are views of the same rows;
their backward is one ``cat``. The invariant checked here: the number of ``slice_backward`` ops of a reference run
does not grow with the number of segments or blocks (control: the per-segment slicing it replaced does).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.ops import OpCounter
from reference import attention_layer, core_attention, numerics, thd

from .helpers import case_of, materialized, run_with_grads, thd_layout, tiny_config


def _segments(lengths):
    out, start = [], 0
    for n in lengths:
        out.append(thd.Segment(start, n, n))
        start += n
    return out


def test_segment_rows_are_the_segments_rows_as_views():
    packed = torch.arange(20.0).view(10, 2)
    segs = _segments([3, 0, 4])  # a tail of 3 slack rows, an empty segment
    pieces = thd.segment_rows(packed, segs)
    assert [p.shape[0] for p in pieces] == [3, 0, 4]
    for p, s in zip(pieces, segs):
        assert torch.equal(p, packed[s.rows]) and (p.numel() == 0 or p.data_ptr() == packed[s.rows].data_ptr())
    # segments that do not tile [0, end) in order are sliced one by one (control of the fallback)
    apart = [thd.Segment(2, 3, 3), thd.Segment(6, 2, 2)]
    assert [torch.equal(p, packed[s.rows]) for p, s in zip(thd.segment_rows(packed, apart), apart)] == [True, True]


def test_segment_rows_backward_is_one_join_and_the_same_gradient():
    segs = _segments([3, 2, 4])
    x = torch.randn(11, 3, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(s.length, 3, dtype=torch.float64) for s in segs]

    def grad_and_ops(cut):
        counter = OpCounter()
        with counter:
            loss = sum((p * w).sum() for p, w in zip(cut(x), weights))
            (g,) = torch.autograd.grad(loss, x)
        return g, counter.ops

    split_grad, split_ops = grad_and_ops(lambda t: thd.segment_rows(t, segs))
    slice_grad, slice_ops = grad_and_ops(lambda t: [t[s.rows] for s in segs])
    assert torch.equal(split_grad, slice_grad)
    assert split_ops["slice_backward"] == 0
    assert slice_ops["slice_backward"] == len(segs)  # the control: one full-size zero fill per segment


def test_row_blocks_follow_row_chunks(monkeypatch):
    monkeypatch.setattr(numerics, "ROW_CHUNK", 4)
    x = torch.arange(2 * 10).view(2, 10)
    blocks = numerics.row_blocks(x)
    assert [b.shape[1] for b in blocks] == [r.stop - r.start for r in numerics.row_chunks(10)] == [4, 4, 2]
    assert all(torch.equal(b, x[:, r]) for b, r in zip(blocks, numerics.row_chunks(10)))


class _FilledBySlices(TorchDispatchMode):
    """Elements that ``slice_backward`` zero-fills (the size of each slice's input, summed) while active."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ == "slice_backward":
            self.elements += out.numel()
        return out


def _filled_by_slices(impl, case) -> int:
    t = materialized(case)
    mode = _FilledBySlices()
    with mode:
        run_with_grads(impl, case, t)
    return mode.elements


@pytest.mark.parametrize("scope", ["layer", "core"])
def test_slice_backward_fills_do_not_grow_with_segments_or_blocks(scope, monkeypatch):
    """What slices' backward zero-fills stays about the rows' own size however many segments or row blocks cut
    them (a segment's own slices fill a segment-sized tensor); the control, a slice of the packed tensors per
    segment, fills each whole packed tensor once per segment."""
    impl = attention_layer if scope == "layer" else core_attention
    config = tiny_config(4)
    one = case_of(config, thd_layout([24]), scope=scope)
    three = case_of(config, thd_layout([8, 8, 8]), scope=scope)
    monkeypatch.setattr(numerics, "ROW_CHUNK", 64)
    base = _filled_by_slices(impl, one)
    assert base > 0  # the probe sees slices (the compressor's own, inside a segment)
    assert _filled_by_slices(impl, three) <= 1.5 * base
    monkeypatch.setattr(numerics, "ROW_CHUNK", 3)
    assert _filled_by_slices(impl, one) <= 1.5 * base
    # controls: the slices these replaced, per segment and per row block, fill whole tensors each time
    with monkeypatch.context() as patched:
        patched.setattr(thd, "segment_rows", lambda packed, segs: [packed[s.rows] for s in segs])
        patched.setattr(numerics, "ROW_CHUNK", 64)
        assert _filled_by_slices(impl, three) > 3 * base

    def sliced_blocks(tensor, dim=1):
        assert dim == 1
        return [tensor[:, rows] for rows in numerics.row_chunks(tensor.shape[1])]

    for name in ("indexer", "indexer_loss", "sparse_attention"):  # the modules (the package exports functions)
        monkeypatch.setattr(importlib.import_module(f"reference.{name}"), "row_blocks", sliced_blocks)
    assert _filled_by_slices(impl, one) > 3 * base
