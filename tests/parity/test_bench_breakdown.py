"""The composition breakdown (``bench --sections breakdown``): every op's time goes to the provider, to the line of
ours that issued it, or to the built-in autograd node that ran it — checked on names and on fake profiler events
(the CUDA attribution), each rule with a control that would be misfiled without it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

from torch.autograd import DeviceType

from bench.breakdown import _union_ms, ancestry, attribute, classify, enclosing_frames, sync_sites


def test_classify_provider_own_frame_and_autograd_node():
    assert classify(["/repo/fused/kernels/cudnn_provider.py(283): sparse_attn_bwd",
                     "/repo/fused/sparse_attention.py(62): sparse_attention_backward"]) == "provider"
    assert classify(["site-packages/cudnn/deepseek_sparse_attention/api.py(10): run",
                     "/repo/fused/indexer.py(80): select_topk"]) == "provider"
    assert classify(["torch/nn/functional.py(5000): pad",
                     "/repo/fused/sparse_attention.py(35): flash_mla_forward"]) \
        == "fused/sparse_attention.py:35 flash_mla_forward"
    # the innermost decisive name wins: an autograd node inside a frame of ours is the node's backward
    assert classify(["autograd::engine::evaluate_function: CatBackward0",
                     "/repo/fused/core_attention.py(90): run_core"]) == "autograd CatBackward0"
    # negative controls: harness frames and torch frames are not sites of the composition
    assert classify(["/repo/bench/workloads.py(166): step", "/repo/cli/main.py(1): main"]) is None
    assert classify(["aten::copy_", "torch/_tensor.py(1): backward"]) is None
    # a file named like a package is not the package: only folders count
    assert classify(["/repo/tools/fused.py(3): helper"]) is None


@dataclass
class _Event:
    """The FunctionEvent fields :func:`attribute` reads."""

    name: str
    device_type: Any = DeviceType.CPU
    kernels: list = field(default_factory=list)
    stack: list = field(default_factory=list)
    cpu_parent: Optional["_Event"] = None
    start: float = 0.0
    end: float = 0.0
    self_cpu_time_total: float = 0.0
    thread: int = 0
    is_user_annotation: bool = False

    @property
    def time_range(self):
        return SimpleNamespace(start=self.start, end=self.end)


def _kernel(us: float):
    return SimpleNamespace(duration=us, name="kernel")


def test_attribute_cuda_events():
    frame = _Event("/repo/fused/sparse_attention.py(62): sparse_attention_backward")
    masked = _Event("aten::masked_fill", cpu_parent=frame, kernels=[_kernel(300)])
    provider = _Event("aten::copy_", cpu_parent=_Event("aten::contiguous", cpu_parent=_Event(
        "/repo/fused/kernels/cudnn_provider.py(280): sparse_attn_bwd")), kernels=[_kernel(200)])
    node = _Event("aten::cat", cpu_parent=_Event("autograd::engine::evaluate_function: CatBackward0"),
                  kernels=[_kernel(100)])
    device = [_Event("k1", DeviceType.CUDA, start=0, end=300), _Event("k2", DeviceType.CUDA, start=250, end=450),
              _Event("k3", DeviceType.CUDA, start=1000, end=1100),
              _Event("cute_kernel", DeviceType.CUDA, start=2000, end=4000)]  # no CPU op: a TVM-FFI launch
    # a record_function range: its device-side span covers its kernels and is attached to it like a kernel
    span = _Event("provider::indexer_backward", DeviceType.CUDA, start=1900, end=4100, is_user_annotation=True)
    ranged = _Event("provider::indexer_backward", kernels=[SimpleNamespace(duration=2200,
                                                                            name="provider::indexer_backward")])
    function = _Event("IndexerSparseAttnFunc", kernels=[_kernel(150)])  # a TVM-FFI launch hung on the Function
    out = attribute([masked, provider, node, ranged, span, function] + device, "cuda")
    assert out["device_ms"] == 2.6
    assert out["busy_ms"] == 2.55  # the union: k1 and k2 overlap by 50 us
    # provider = the op inside the provider frame (0.2) + the launch on the Function's range (0.15) + the device
    # time no op launched (2.6 - 0.75)
    assert out["provider_ms"] == 2.2
    assert out["composition_ms"] == 0.4
    assert [(s["site"], s["op"], s["ms"]) for s in out["sites"]] == [
        ("fused/sparse_attention.py:62 sparse_attention_backward", "aten::masked_fill", 0.3),
        ("autograd CatBackward0", "aten::cat", 0.1)]
    # negative control: counted as device work, the span would double the provider's time
    span.is_user_annotation = False
    assert attribute([masked, provider, node, ranged, span] + device, "cuda")["device_ms"] == 4.8
    # negative control: on the CPU a non-op range is never a provider launch (only ATen ops' self time counts)
    assert attribute([function], "cpu")["sites"] == []


def test_attribute_cpu_uses_self_time_of_aten_ops():
    frame = _Event("/repo/fused/compressor.py(37): _overlap")
    ops = [_Event("aten::roll", cpu_parent=frame, self_cpu_time_total=500),
           _Event("aten::roll", cpu_parent=frame, self_cpu_time_total=250),
           _Event("/repo/fused/compressor.py(37): _overlap", self_cpu_time_total=9999)]  # not an op: ignored
    out = attribute(ops, "cpu")
    assert out["busy_ms"] is None and out["provider_ms"] == 0
    assert out["sites"] == [{"site": "fused/compressor.py:37 _overlap", "op": "aten::roll", "calls": 2, "ms": 0.75}]


def test_ancestry_reads_recorded_stacks_and_parents():
    root = _Event("/repo/fused/layer.py(10): attention_layer")
    leaf = _Event("aten::mm", stack=["/repo/fused/ops.py(25): linear"], cpu_parent=_Event("aten::matmul",
                                                                                           cpu_parent=root))
    assert ancestry(leaf) == ["aten::mm", "/repo/fused/ops.py(25): linear", "aten::matmul", root.name]
    assert ancestry(leaf, {id(leaf): ["/repo/fused/layer.py(3): f"]})[-1] == "/repo/fused/layer.py(3): f"


def test_enclosing_frames_by_time_on_the_same_thread():
    """Profilers that record Python-function events without parenting ops to them: the frames are found by time."""
    outer = _Event("/repo/fused/core_attention.py(90): run_core", start=0, end=100)
    inner = _Event("/repo/fused/compressor.py(37): _overlap", start=10, end=20)
    op_in = _Event("aten::roll", start=12, end=15)
    op_out = _Event("aten::cat", start=30, end=40)  # after _overlap returned: only run_core encloses it
    other = _Event("aten::mm", start=12, end=15)
    other.thread = 2  # another thread: no frame of thread 1 encloses it
    for e in (outer, inner, op_in, op_out):
        e.thread = 1
    frames = enclosing_frames([op_out, inner, other, outer, op_in])
    assert frames[id(op_in)] == [inner.name, outer.name]
    assert frames[id(op_out)] == [outer.name]
    assert id(other) not in frames
    assert classify(ancestry(op_out, frames)) == "fused/core_attention.py:90 run_core"


def test_provider_range_wins_over_the_frames_outside_it():
    cute = _Event("provider::indexer_backward", cpu_parent=_Event("IndexerSparseAttnFunc", cpu_parent=_Event(
        "/repo/fused/indexer_loss.py(240): forward")))
    assert classify(ancestry(cute)) == "provider"
    # negative control: without the range the same launch is filed under the composition's line
    assert classify(ancestry(cute.cpu_parent)) == "fused/indexer_loss.py:240 forward"


def test_union_of_intervals():
    assert _union_ms([(0, 1000), (500, 1500), (3000, 4000)]) == 2.5
    assert _union_ms([(0, 1000), (100, 200)]) == 1.0  # contained
    assert _union_ms([]) == 0


def test_composition_range_names_the_function():
    assert classify(["aten::roll", "fused::compressor._overlap", "/repo/bench/workloads.py(1): step"]) \
        == "fused/compressor.py _overlap"
    # the provider range inside a composition function wins (innermost first)
    assert classify(["aten::copy_", "provider::sparse_attn_bwd", "fused::sparse_attention.sparse_attention_backward"]) \
        == "provider"


def test_composition_ranges_give_sites_without_python_frames():
    """Without stacks (as torch 2.11 records CUDA runs) the ranges still name the composition's functions; they are
    restored afterwards. Negative control: the same profile without the ranges has no composition site."""
    import importlib

    import fused
    from torch.profiler import ProfilerActivity, profile

    from bench.breakdown import CompositionRanges, provider_ranges
    from bench.workloads import Workload, forward_backward, make_tensors
    from parity.impls import load

    work = Workload("tiny", 64, scope="core")
    impl = load("fused")
    step = forward_backward(impl.api, work.case, make_tensors(work, "cpu"), impl.context(impl.resolve_provider("auto")))
    step()
    core_module = importlib.import_module("fused.core_attention")  # fused.core_attention is also the function
    compressor_module = importlib.import_module("fused.compressor")
    original = core_module.compress_sbhd, compressor_module._pool, fused.core_attention

    def sites(ranges: bool) -> set:
        with provider_ranges():
            with (CompositionRanges() if ranges else contextlib.nullcontext()):
                with profile(activities=[ProfilerActivity.CPU], with_stack=False) as prof:
                    step()
        return {s["site"] for s in attribute(prof.events(), "cpu")["sites"]}

    with_ranges = sites(True)
    assert any(s.startswith("fused/compressor.py ") for s in with_ranges), with_ranges
    assert (core_module.compress_sbhd, compressor_module._pool, fused.core_attention) == original
    assert not any(s.startswith("fused/") for s in sites(False))


def test_sync_sites_counts_sync_warnings_by_line_of_ours():
    W = SimpleNamespace
    records = [W(message="called a synchronizing CUDA operation", filename="/x/repo/fused/thd.py", lineno=12),
               W(message="called a synchronizing CUDA operation", filename="/x/repo/fused/thd.py", lineno=12),
               W(message="called a synchronizing CUDA operation", filename="/site-packages/cudnn/api.py", lineno=7),
               W(message="some other warning", filename="/x/repo/fused/ops.py", lineno=3)]
    out = sync_sites(records)
    assert out["count"] == 3
    assert out["sites"] == [{"site": "fused/thd.py:12", "count": 2}, {"site": "cudnn/api.py:7", "count": 1}]
    assert sync_sites([records[-1]]) == {"count": 0, "sites": []}  # negative control: not a sync warning


def test_the_profilers_native_chatter_is_dropped_and_everything_else_kept(capfd):
    import os

    from bench.breakdown import profiler_chatter_dropped, profile_step

    with profiler_chatter_dropped():
        os.write(2, b"USDT:2026-12-03 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a warning the user must see\n")
        os.write(2, b"STAGE:2026-12-03 Completed Stage: Warm Up\n")
    err = capfd.readouterr().err
    assert err == "a warning the user must see\n"
    profile_step(lambda: None, "cpu")  # the real profiler: none of its start / stop lines reach the log
    assert "USDT:" not in capfd.readouterr().err


def test_progress_lines_never_say_none_ms():
    from bench.output import ms_part

    assert ms_part("idle", None) == "" and ms_part("wall", 12.3456) == "wall 12.3 ms" and ms_part("", 5.0) == "5 ms"
