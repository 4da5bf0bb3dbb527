"""The reference's row gather: the plain indexing forward, and a gradient bit-identical to autograd's deterministic
``index_put_(accumulate=True)`` (duplicates added one at a time, in index order), in either schedule: rank by rank
(the CPU's) or one segmented reduction (CUDA's)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from reference.sparse_attention import (gather_rows, row_runs, sum_rows_in_order, sum_runs_by_rank,
                                        sum_runs_by_segments)

DTYPES = [torch.float64, torch.float32, torch.bfloat16]
SCHEDULES = [sum_runs_by_rank, sum_runs_by_segments]


class OpNames(TorchDispatchMode):
    """Records the name of every ATen op dispatched while active (``names``, in order)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def plain_gather(kv_full: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The gather autograd differentiates by itself (the spec's ``kv_full[b, ids]``)."""
    batch = torch.arange(kv_full.shape[0], device=kv_full.device).view(-1, 1, 1)
    return kv_full[batch, ids.clamp(min=0)]


def grads(gather, kv_full: torch.Tensor, ids: torch.Tensor, dout: torch.Tensor) -> tuple:
    leaf = kv_full.clone().requires_grad_(True)
    out = gather(leaf, ids)
    out.backward(dout)
    return out.detach(), leaf.grad


def heavy_duplicates(device: str, dtype: torch.dtype, B: int = 2, N: int = 40, s: int = 48, k: int = 24):
    """Ids where some rows repeat dozens of times (a window and a few popular keys), like a block's key sets."""
    g = torch.Generator().manual_seed(7)
    window = (torch.arange(s).view(s, 1) + torch.arange(k // 2)).clamp(max=N - 1)
    popular = torch.randint(0, 5, (s, k - k // 2), generator=g)
    ids = torch.cat((window, popular), dim=1).expand(B, s, k).clone()
    ids[1] = torch.randint(0, N, (s, k), generator=g)
    # rows of 64 elements: on CUDA, torch's kernel for rows narrower than a warp sums a bf16 row's duplicates in
    # float32 and rounds once (the reference's rows are head dims, 64 and up; the generic kernel rounds per addition)
    kv = torch.randn(B, N, 64, generator=g, dtype=torch.float64).to(dtype)
    dout = torch.randn(B, s, k, 64, generator=g, dtype=torch.float64).to(dtype)
    return kv.to(device), ids.to(device), dout.to(device)


def devices() -> list:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_is_bit_identical_to_autograds_index_put(device, dtype):
    torch.use_deterministic_algorithms(True, warn_only=True)
    kv, ids, dout = heavy_duplicates(device, dtype)
    out, grad = grads(gather_rows, kv, ids, dout)
    want_out, want = grads(plain_gather, kv, ids, dout)
    assert torch.equal(out, want_out)
    assert torch.equal(grad, want)
    assert int(torch.bincount(ids[0].reshape(-1)).max()) >= 20  # the duplicates the schedule is for


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_another_order_of_the_same_terms_differs(dtype):
    """The bit-identity above is a real check: adding the same duplicates in reverse order changes the result."""
    kv, ids, dout = heavy_duplicates("cpu", dtype)
    _, want = grads(plain_gather, kv, ids, dout)
    flat = (ids + kv.shape[1] * torch.arange(kv.shape[0]).view(-1, 1, 1)).reshape(-1)
    values = dout.reshape(-1, dout.shape[-1])
    reversed_order = sum_rows_in_order(values.flip(0), flat.flip(0), kv.shape[0] * kv.shape[1])
    close = 1e-3 if dtype != torch.bfloat16 else 1.0  # the same sums, other roundings (bf16: one per addition)
    assert torch.allclose(reversed_order.view_as(want).double(), want.double(), rtol=close, atol=close)
    assert not torch.equal(reversed_order.view_as(want), want)


def test_padding_slots_read_row_0_and_send_it_no_gradient():
    kv = torch.randn(1, 6, 4, dtype=torch.float64)
    ids = torch.tensor([[[2, -1, -1], [3, 2, -1]]])
    dout = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    out, grad = grads(gather_rows, kv, ids, dout)
    assert torch.equal(out[0, 0, 1], kv[0, 0]) and torch.equal(out[0, 1, 2], kv[0, 0])
    assert torch.equal(grad[0, 0], torch.zeros(4, dtype=torch.float64))
    assert torch.equal(grad[0, 2], dout[0, 0, 0] + dout[0, 1, 1])
    assert torch.equal(grad[0, 3], dout[0, 1, 0])
    _, plain = grads(plain_gather, kv, ids, dout)  # negative control: autograd's own gather sends them to row 0
    assert not torch.equal(plain[0, 0], torch.zeros(4, dtype=torch.float64))


def test_no_ids_and_only_padding_give_zero_gradients():
    values = torch.randn(3, 5)
    assert torch.equal(sum_rows_in_order(values, torch.tensor([-1, -1, -1]), 4), torch.zeros(4, 5))
    assert torch.equal(sum_rows_in_order(values[:0], torch.zeros(0, dtype=torch.int64), 2), torch.zeros(2, 5))


def test_one_add_per_duplicate_rank_and_no_copy_back():
    """The schedule's launch count: ranks 2..L of the longest run each take one in-place add on a view of the
    accumulator; ``acc[:n] += x`` would copy the view back onto itself as well (a second kernel per rank on CUDA).
    Control: the same loop written with ``+=`` on the slice dispatches that copy."""
    ids = torch.tensor([3, 1, 3, 3, 0, 1, 3])                # row 3 four times: ranks 1..4
    values = torch.randn(ids.numel(), 8, dtype=torch.float64)
    with OpNames() as seen:
        sum_rows_in_order(values, ids, 5)
    assert seen.names.count("add_") == 3 and "copy_" not in seen.names
    acc, more = torch.zeros(4, 8), torch.ones(2, 8)
    with OpNames() as augmented:
        acc[:2] += more
    assert augmented.names.count("copy_") == 1


def test_no_rows_and_int32_ids_are_accepted():
    """Edge inputs the scheduled sum takes as the plain one did (found by review): no destination rows (every id
    dropped), and int32 ids."""
    values = torch.randn(3, 5)
    assert sum_rows_in_order(values, torch.tensor([-1, -1, -1]), 0).shape == (0, 5)
    ids = torch.tensor([2, 0, 2], dtype=torch.int32)
    want = torch.zeros(3, 5).index_put_((ids.long(),), values, accumulate=True)
    assert torch.equal(sum_rows_in_order(values, ids, 3), want)


def sequential_sum(values: torch.Tensor, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """The definition, entry by entry into zeros: ``out[ids[m]] += values[m]`` for ``m = 0, 1, ...`` in
    ``values.dtype`` (so a row of only ``-0.0`` entries is ``+0.0 + -0.0 = +0.0``)."""
    out = values.new_zeros((rows, values.shape[-1]))
    for m, r in enumerate(ids.tolist()):
        if r >= 0:
            out[r] = out[r] + values[m]
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so ``-0.0`` and ``+0.0`` differ)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def zero_signed_entries(dtype: torch.dtype, seed: int):
    """``(values [400, 7], ids [400], rows)``: magnitudes far apart (the rounding order shows), a fifth of the
    entries ``-0.0``, dropped ids, row 5 without entries and row 7 with only ``-0.0`` entries."""
    g = torch.Generator().manual_seed(seed)
    M, rows, D = 400, 30, 7
    values = (torch.randn(M, D, generator=g) * torch.exp(3 * torch.randn(M, 1, generator=g))).to(dtype)
    values[torch.rand(M, D, generator=g) < 0.2] = -0.0
    ids = torch.randint(-2, rows, (M,), generator=g)
    ids[ids == 5] = 6
    values[ids == 7] = -0.0
    return values, ids, rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_definition_is_autograds_index_put_bit_for_bit(dtype):
    """The oracle below is what autograd computes, signs of zero included (a row of only ``-0.0`` is ``+0.0``)."""
    values, ids, rows = zero_signed_entries(dtype, 10)
    kept = ids >= 0
    autograd = values.new_zeros((rows, values.shape[-1])).index_put_((ids[kept],), values[kept], accumulate=True)
    assert torch.equal(bits(sequential_sum(values, ids, rows)), bits(autograd))
    assert bits(autograd[7]).eq(0).all()


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_schedule_adds_entry_by_entry_signs_of_zero_included(schedule, dtype):
    """Both schedules give the sequential sum's bits (an empty row and a row of only ``-0.0`` are ``+0.0``)."""
    for seed in range(6):
        values, ids, rows = zero_signed_entries(dtype, seed)
        got = schedule(values, *row_runs(ids, rows))
        assert torch.equal(bits(got), bits(sequential_sum(values, ids, rows)))
        assert bits(got[5]).eq(0).all() and bits(got[7]).eq(0).all()


def test_negative_control_a_sum_that_starts_from_its_first_entry_keeps_a_negative_zero():
    """The sign check above can fail: a running sum started from the run's first entry (not from zero) leaves a row
    of only ``-0.0`` at ``-0.0``."""
    values, ids = torch.tensor([[-0.0], [-0.0]]), torch.tensor([0, 0])
    _, perm, bounds = row_runs(ids, 1)
    from_first = torch.segment_reduce(values.index_select(0, perm), "sum", offsets=bounds[:-1], axis=0, unsafe=True,
                                      initial=-0.0)
    assert not torch.equal(bits(from_first), bits(sequential_sum(values, ids, 1)))


def test_the_segmented_schedule_takes_the_same_ops_whatever_the_duplicates():
    """CUDA's schedule launches a fixed number of kernels: a row repeated 4 or 40 times costs the same ops (control:
    the rank schedule takes one more add per rank)."""
    def ops(schedule, repeats):
        ids = torch.cat((torch.full((repeats,), 3), torch.tensor([1, 0, -1])))
        runs = row_runs(ids, 5)
        with OpNames() as seen:
            schedule(torch.randn(ids.numel(), 8, dtype=torch.float64), *runs)
        return seen.names

    assert ops(sum_runs_by_segments, 4) == ops(sum_runs_by_segments, 40)
    assert "add_" not in ops(sum_runs_by_segments, 40)
    assert ops(sum_runs_by_rank, 40).count("add_") - ops(sum_runs_by_rank, 4).count("add_") == 36
