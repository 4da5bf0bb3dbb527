"""The three bugs found in review of the production feature, planted back in (``parity.mutation.mutants``): each one makes a
harness check fail on the CPU, and the same check passes without it.

1. The THD dense-loss indexer-backward call made without ``max_seqlen_q/k`` — the kernel contract refuses it.
2. The SBHD indexer gradients turned back with ``.view`` instead of a permute — right only for batch 1, so the
   batch-2 parity check fails while batch 1 still passes.
3. ``kv_full`` sized for the true compressed count instead of the capacity — the capacity-padding rows are routed
   past the end of the buffer; a case whose capacity exceeds the true count fails, an exact-capacity one does not.
"""

from __future__ import annotations

import pytest

from parity.mutation import mutants

from .helpers import bshd_case, thd_case
from .test_parity import assert_parity

THD_DENSE = thd_case(4, [(9, 12), (0, 0), (13, 16)], slack=2, capacity=9, dsa_indexer_use_sparse_loss=False)


def test_missing_max_seqlen_in_thd_dense_backward_is_caught():
    assert_parity(THD_DENSE)
    with mutants.activate("thd_dense_bwd_no_max_seqlen"):
        with pytest.raises(ValueError, match="THD dense indexer backward requires batch and max_seqlen_q/k"):
            assert_parity(THD_DENSE)


def test_view_over_a_batch_that_is_not_1_is_caught():
    batch2, batch1 = bshd_case(4, 2, 21), bshd_case(4, 1, 21)
    assert_parity(batch2)
    with mutants.activate("view_over_batch"):
        assert_parity(batch1)  # the view is right for a batch of 1: why the bug went unnoticed
        with pytest.raises(AssertionError, match="grad/core_attention.indexer"):
            assert_parity(batch2)


def test_invalid_compressed_rows_routed_out_of_bounds_is_caught():
    over = thd_case(4, [(9, 12), (13, 16)], slack=1, capacity=9)   # 7 true rows, 2 tail rows
    exact = thd_case(4, [(9, 12), (13, 16)], slack=1, capacity=7)
    assert_parity(over)
    with mutants.activate("invalid_comp_rows_oob"):
        assert_parity(exact)  # no tail row to misroute
        with pytest.raises(IndexError, match="out of bounds"):
            assert_parity(over)
