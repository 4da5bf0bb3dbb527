"""Sign-split's record (:mod:`reference.activation`): counted on the device during the run, read back once when the
pattern's context exits, with the values of counting each row block on the host (issue 22: no device sync per
row block of the reference)."""

from __future__ import annotations

import torch

from reference import activation
from bench.ops import HostReads


def _block(seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 3, 2, 4, dtype=torch.float64, generator=g)
    k = torch.randn(1, 1, 5, 4, dtype=torch.float64, generator=g)
    active = torch.rand(1, 3, 2, 5, generator=g) < 0.5
    return q, k, q @ k.transpose(-1, -2), active


def _host_count(blocks, window):
    """What the record held when every block was counted on the host."""
    adopted = rejected = 0
    usage = 0.0
    for q, k, dots, active in blocks:
        scale = torch.sqrt(q.square() @ k.square().transpose(-1, -2))
        ambiguous = dots.abs() <= window * scale
        differ = active != (dots > 0)
        adopted += int((differ & ambiguous).sum())
        rejected += int((differ & ~ambiguous).sum())
        if differ.any():
            usage = max(usage, float((dots.abs() / (window * scale))[differ].max()))
    return {"relu_adopted": adopted, "relu_rejected": rejected, "relu_window_usage": usage}


def test_record_is_read_back_once_with_the_host_counts():
    blocks = [_block(seed) for seed in range(3)]
    window = 0.3
    with HostReads() as inside:
        with activation.use_activation_pattern(blocks[0][3], window) as handle:
            for q, k, dots, active in blocks:
                activation.relu(dots, q, k, active, window, handle.record)
            during = inside.total
    assert during == 0 and inside.total == 1  # nothing while the blocks run, one read at the exit
    expected = _host_count(blocks, window)
    assert handle.record == expected and expected["relu_adopted"] > 0 and expected["relu_rejected"] > 0
    assert isinstance(handle.record["relu_adopted"], int) and isinstance(handle.record["relu_window_usage"], float)
    # control: the counts see the pattern (a pattern equal to the reference's own signs differs nowhere)
    with activation.use_activation_pattern(blocks[0][3], window) as same:
        for q, k, dots, _ in blocks:
            activation.relu(dots, q, k, dots > 0, window, same.record)
    assert same.record == {"relu_adopted": 0, "relu_rejected": 0, "relu_window_usage": 0.0}
