"""The graph-replay oracle on the CPU: its re-packings, its ``unsupported`` verdict without CUDA, and its comparison
logic with a stand-in for the CUDA graph (an eager re-run on the step's buffers), with a negative control that bakes
the capture packing into the "graph" as a host read would."""

import pytest
import torch

from cases.layout import ThdLayout
from parity import impls
from parity.engine import RunOptions
from parity.oracles import metamorphic, graph_replay as GR
from parity.oracles.metamorphic import applicable, run_oracle
from tests.parity.helpers import pick


def eager_stand_in(fn):
    """``(graph, result)`` like :func:`parity.oracles.graph_replay.capture_graph`; ``replay`` re-runs ``fn`` eagerly."""
    result = fn()

    class Graph:
        def replay(self):
            fresh = fn()
            result.clear()
            result.update(fresh)

    return Graph(), result


def baked_stand_in(fn):
    """A "graph" that kept the capture packing's cu_seqlens (a host read at capture time): every replay runs on them."""
    step = fn.__self__
    baked = (step.psp.cu_seqlens_q.clone(), step.psp.cu_seqlens_q_padded.clone())
    graph, result = eager_stand_in(fn)

    class Baked:
        def replay(self):
            now = (step.psp.cu_seqlens_q.clone(), step.psp.cu_seqlens_q_padded.clone())
            for t, v in zip((step.psp.cu_seqlens_q, step.psp.cu_seqlens_q_padded), baked):
                t.copy_(v)
            graph.replay()
            for t, v in zip((step.psp.cu_seqlens_q, step.psp.cu_seqlens_q_padded), now):
                t.copy_(v)

    return Baked(), result


@pytest.fixture(scope="module")
def case():
    return pick(layout="thd", ratio="4", loss="sparse", sequences="2-3", scope="layer", dtype="float32")


def test_repackings_keep_the_buffer_and_segment_count_and_differ(case):
    lay = case.layout
    others = GR.repackings(lay)
    assert len(others) >= 2
    keys = {(o.cu_seqlens, o.cu_seqlens_padded) for o in others}
    assert len(keys) == len(others) and (lay.cu_seqlens, lay.cu_seqlens_padded) not in keys
    for o in others:
        assert o.total_tokens == lay.total_tokens and o.num_segments == lay.num_segments
        GR.static_layout(o, 4).validate_for_ratio(4)  # the static capacity holds every packing
    single = ThdLayout(cu_seqlens=(0, 5), cu_seqlens_padded=(0, 8), total_tokens=8)
    assert [o.real_lengths for o in GR.repackings(single)] == [(3,)]  # only the halved real length differs
    assert GR.repackings(ThdLayout(cu_seqlens=(0, 1), cu_seqlens_padded=(0, 1), total_tokens=1)) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_graph_replay_is_unsupported_without_cuda(case):
    assert applicable("graph-replay", case)
    result = run_oracle("graph-replay", case, impls.load("fused"), RunOptions(device="cpu"))
    assert result.outcome == "unsupported" and "CUDA device" in result.message
    bshd = pick(layout="bshd", ratio="0", dtype="float32")
    assert not applicable("graph-replay", bshd)


def _replay(case, capture):
    runner = metamorphic._Runner(impls.load("fused"), "torch", "cpu")
    return metamorphic._graph_replay(case, runner, 0.0, capture=capture), runner


def test_graph_replay_logic_passes_with_a_faithful_replay(case):
    tensors, runner = _replay(case, eager_stand_in)
    packings = 1 + len(GR.repackings(case.layout))
    assert {t.name.split(":")[0] for t in tensors} == {f"pack{i}" for i in range(packings)}
    assert sum(t.name.endswith(":control") for t in tensors) == packings - 1
    assert any(t.name.endswith(":grad/hidden") for t in tensors)
    assert all(t.verdict == "pass" for t in tensors), [t.message for t in tensors if t.failed]
    assert set(runner.plan.values()) == {"torch"}


def test_graph_replay_catches_a_replay_that_kept_the_capture_packing(case):
    tensors, _ = _replay(case, baked_stand_in)
    failed = {t.name for t in tensors if t.failed}
    assert not any(name.startswith("pack0:") for name in failed)  # the capture packing itself replays right
    assert "pack1:out" in failed or "pack1:grad/hidden" in failed
    assert not any(name.endswith(":control") for name in failed)  # the packings are told apart


def test_graph_replay_control_fails_when_a_packing_cannot_be_told_apart(case, monkeypatch):
    """A "re-packing" equal to the capture packing: replay and eager agree, but the check has no teeth there."""
    monkeypatch.setattr(GR, "repackings", lambda layout: [layout])
    tensors, _ = _replay(case, eager_stand_in)
    assert [t.name for t in tensors if t.failed] == ["pack1:control"]
