"""``--cp N``: production's THD context-parallel branch over N gloo rank processes (``adapters/megatron/cp.py``).

The stand-ins for the CuTeDSL CP layout kernels against their documented contract (hand-worked examples), the
partition, the CLI's usage errors, then on the pinned snapshot (one test, one rank pool per CP size, shared): a CP
smoke subset per provider (every case ``pass`` or a registered ``known``), every CP registry entry reproducing at
its CP sizes (the mean-loss entry at exactly its model), and the ``cp`` oracle passing at head. The CP mutants
(killed, and failing the oracle) are ``slow``: one rank pool per mutant."""

from __future__ import annotations

import pytest
import torch

from adapters.megatron import cp as cpm
from adapters.megatron import cp_standins as st
from cases.profiles import get_profile
from tests.adapters.test_megatron import _entries, needs_megatron

CPU_PROVIDERS = ("unfused", "emulated")


# ---- the partition ------------------------------------------------------------------------------------------------
def test_partition_gives_equal_slices_no_shorter_than_the_boundary():
    tiny = get_profile("tiny")
    assert [cpm.d_window(tiny.config(r)) for r in (0, 4, 128)] == [8, 8, 128]
    assert cpm.d_window(tiny.config(4, csa_window_size=16)) == 16
    assert cpm.partition(96, 4, tiny.config(4)) == cpm.Partition(4, 96, 24)  # divides: no padding
    assert cpm.partition(21, 2, tiny.config(4)).total == 22  # capacity padding to N equal slices
    short = cpm.partition(200, 2, tiny.config(128))  # production's exchange needs l_local >= D_window
    assert short.local == 128 and short.total == 256 and short.span(1) == (128, 256)
    parts = cpm._slices(torch.arange(5.0).view(5, 1), cpm.Partition(2, 5, 3))
    assert [p.flatten().tolist() for p in parts] == [[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]  # padded rows are zero


# ---- the CP layout stand-ins against the documented contract ------------------------------------------------------
def test_compressor_input_compact_copies_the_visible_groups_and_scatters_their_gradient_back():
    # rank rows [8, 16) of segments [0, 10) and [10, 22); ratio 4, d_comp 8, D_window 8, capacity 4 groups
    cu = torch.tensor([0, 10, 22], dtype=torch.int32)
    src, ids = st.compact_sources(cu, 8, 8, 4, 8, 4)
    # segment 0: groups 0 and 1 (rows 0-7, the boundary); segment 1: group 0 (rows 10-13, local); group 1 of
    # segment 1 (rows 14-17) ends past the rank: not visible
    assert ids.tolist() == [0, 1, 0, -1]
    assert src.tolist() == list(range(8)) + [10, 11, 12, 13] + [-1] * 4
    local = torch.arange(8.0, 16.0).view(8, 1).requires_grad_(True)  # values = global row ids
    boundary = torch.arange(0.0, 8.0).view(8, 1).requires_grad_(True)
    out, comp = st.CompressorInputCompact.apply(local, boundary, cu, 8, 4, 8, 4)
    assert out.flatten().tolist() == [float(r) for r in range(8)] + [10.0, 11.0, 12.0, 13.0] + [0.0] * 4
    assert torch.equal(comp, ids)
    weight = torch.arange(1.0, 17.0).view(16, 1)
    (out * weight).sum().backward()
    assert boundary.grad.flatten().tolist() == [float(w) for w in range(1, 9)]
    assert local.grad.flatten().tolist() == [0.0, 0.0, 9.0, 10.0, 11.0, 12.0, 0.0, 0.0]  # rows 10-13 only
    # negative control: with d_comp 0 the boundary groups are no longer visible
    assert st.compact_sources(cu, 8, 8, 4, 0, 4)[1].tolist() == [0, -1, -1, -1]


def _indices(**kw):
    """Rank 1 of 2 (rows [10, 20), D_window 8, window 4, ratio 4, 4 compressed columns) over segments [0, 6) and
    [6, 20) (compressed counts 1 and 3); sequence-major row m lives at rank-major row ``map[m]``."""
    args = dict(cu_seqlens=torch.tensor([0, 6, 20], dtype=torch.int32), global_start=10, l_local=10, d_window=8,
                window_size=4, ratio=4, compressed_width=4,
                cu_seqlens_compressed=torch.tensor([0, 1, 4], dtype=torch.int32),
                seq_to_rank_row=torch.tensor([5, 0, -1, 2, 3], dtype=torch.int32))
    args.update(kw)
    return st.build_attention_indices(**args)


def test_attention_indices_of_all_visible_compressed_rows():
    idx, length, major = _indices()
    assert major is None and idx.dtype == torch.int32 and idx.shape == (10, 8)
    # row 10 (position 4): window positions 7-10 -> boundary rows 5, 6, 7, local row 0 (= 8); compressed id 0 of
    # segment 1 -> sequence-major row 1 -> rank-major 0 -> base 18
    assert idx[0].tolist() == [5, 6, 7, 8, 18, -1, -1, -1] and length[0] == 5
    # row 19 (position 13): window 16-19 -> 14..17; ids 0, 1, 2 -> rows 1, 2, 3 -> 0, -1 (unmapped), 2 in place
    assert idx[9].tolist() == [14, 15, 16, 17, 18, -1, 20, -1] and length[9] == 7


def test_attention_indices_of_a_selection_and_of_the_indexer_loss():
    sel = torch.full((10, 4), -1, dtype=torch.int32)
    sel[9] = torch.tensor([2, 0, 7, 1])  # 7: past the segment's 3 rows; 1 -> sequence-major row 2: unmapped
    idx, length, _ = _indices(compressed_topk=sel)
    assert idx[9].tolist() == [14, 15, 16, 17, 20, 18, -1, -1] and length[9] == 6  # valid ids compacted, in order
    loss_idx, none, major = _indices(compressed_topk=sel, for_indexer_loss=True)
    assert none is None
    assert loss_idx[9].tolist() == [20, 18, -1, -1, 14, 15, 16, 17]  # selected ids in their columns, then window
    assert major[9].tolist() == [2, 0, -1, -1]


def test_attention_indices_of_a_row_outside_every_sequence():
    cu = torch.tensor([0, 6, 16], dtype=torch.int32)  # rows 16-19 of the rank are past the last boundary
    idx, length, _ = _indices(cu_seqlens=cu)
    assert idx[6].tolist() == [0] + [-1] * 7 and length[6] == 1  # key 0 of the rank's buffer, length 1
    assert idx[5].tolist()[:4] == [10, 11, 12, 13]  # control: the last real row (15) keeps its window 12-15
    loss_idx, _, major = _indices(cu_seqlens=cu, compressed_topk=torch.zeros((10, 4), dtype=torch.int32),
                                  for_indexer_loss=True)
    assert loss_idx[6].tolist() == [-1] * 8 and major[6].tolist() == [-1] * 4  # the loss layout: nothing


def test_zigzag_pos_emb_stand_in_selects_chunks_rank_and_mirror():
    class Group:
        def __init__(self, rank):
            self._rank = rank

        def size(self):
            return 2

        def rank(self):
            return self._rank

    table = torch.arange(16.0).view(16, 1, 1, 1)
    assert st.get_pos_emb_on_this_cp_rank(table, 0, Group(0)).flatten().tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert st.get_pos_emb_on_this_cp_rank(table, 0, Group(1)).flatten().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


# ---- usage --------------------------------------------------------------------------------------------------------
def test_cp_usage_errors_are_one_line(capsys):
    from cli.main import main

    assert main(["run", "--impl", "fused", "--cp", "2", "--case-id", "ab101a5d94c2", "--suite", "smoke"]) == 2
    assert "--cp 2: implementation 'fused' has no context parallelism" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--cp 3"):
        with cpm.use_context_parallel(3):
            pass
    assert cpm.size() == 1


def test_registry_entries_hold_at_the_cp_sizes_they_list():
    import adapters.megatron as mg

    ids = {n: {e["id"] for e in _with_cp(mg.known_deviations, n)} for n in (1, 2, 4)}
    assert "cp-thd-rows-past-last-boundary-attend-key-0" in ids[2] - ids[1]
    assert "f64-thd-indexer-loss-backward-dtype" in ids[1] - ids[2]  # the CP path .float()s the weights
    assert "thd-core-padding-grad-unmasked" in ids[1] & ids[2] & ids[4]
    assert all(set(e.get("cp", [1])) <= set(cpm.SIZES) for e in _entries())


def _with_cp(fn, n):
    with cpm.use_context_parallel(n):
        return fn()


# ---- production at CP = 2 and 4 (one pool per size, shared by the whole test) -------------------------------------
#: THD smoke cases that pass at CP: layer / core, r 0 / 4 / 128, train / eval, sparse / dense, loss coefficient 0
CP_SUBSET = ("ab101a5d94c2", "03836235949d", "140993f2140a", "9595c54698e9", "bd311708ae0e", "51ed1802b744",
             "acbefb051d6e")


def _run_at(case_ids, provider, n):
    from cases.suites import load_suite
    from parity.engine import RunOptions, run_case
    from parity.impls import load

    cases = {c.id: c for c in load_suite("smoke")}
    impl, ref = load("megatron"), load("reference")
    options = RunOptions(impl="megatron", provider=provider, device="cpu", cp=n)
    with impl.parallel(n):
        return {cid: run_case(cases[cid], impl, ref, options) for cid in case_ids}


def _check_registry(sizes) -> None:
    """Every entry that holds under CP reproduces on its cases at each of its CP sizes in ``sizes``, on each CPU
    provider it lists (explained by it, alone or with another entry)."""
    for entry in _entries():
        for n in (s for s in entry.get("cp", [1]) if s in sizes):
            for provider in [p for p in entry["providers"] if p in CPU_PROVIDERS]:
                for cid, r in _run_at(entry["cases"], provider, n).items():
                    assert r.outcome == "known", (entry["id"], n, provider, cid, r.outcome, r.message)
                    assert entry["id"] in r.known["id"].split("+"), (entry["id"], cid, r.known)


@needs_megatron
def test_production_at_cp_2_and_4_against_the_reference_on_the_whole_pack():
    """CP = 2 on both providers (and the registry at CP = 2), CP = 4 on two cases: about 2 min on 2 shared cores,
    most of it the two rank pools' start (a rank imports torch and Megatron) and the cases' sign-split forwards."""
    for provider in CPU_PROVIDERS:
        results = _run_at(CP_SUBSET, provider, 2)
        bad = {cid: f"{r.outcome}: {r.message}" for cid, r in results.items() if r.outcome != "pass"}
        assert not bad, (provider, bad)
        names = {t.name for t in results["ab101a5d94c2"].tensors}
        assert {"out", "topk_indices", "index_scores", "indexer_loss", "grad/hidden",
                "grad/core_attention.indexer.linear_wq_b.weight"} <= names  # gathered on the whole pack
        zero = results["51ed1802b744"]  # loss coefficient 0: the indexer's zero gradients compared
        assert [t.verdict for t in zero.tensors if t.name.startswith("grad/core_attention.indexer.")] == ["pass"] * 6
    _check_registry({2})
    four = _run_at(("ab101a5d94c2", "03836235949d"), "unfused", 4)  # middle ranks both send and receive
    assert {cid: r.outcome for cid, r in four.items()} == dict.fromkeys(four, "pass")


@needs_megatron
@pytest.mark.slow
def test_every_cp_registry_entry_reproduces_at_cp_4():
    """The registry at CP = 4 as well (the CLI's ``--cp 4`` smoke shows the same; slow: another 2 min)."""
    _check_registry({4})


@needs_megatron
def test_the_fused_cp_mean_loss_matches_its_registered_model_exactly():
    """fused-thd-cp-mean-loss-over-cp-buffer-rows: production's loss = contract × real rows / (N·l_local)."""
    from cases.suites import load_suite
    from cases.tensors import materialize
    from parity.impls import load
    from parity.judge.snapshot import take_snapshot

    impl = load("megatron")
    for cid, n in (("f2ceea9c0311", 2), ("339801b464f2", 4)):
        case = next(c for c in load_suite("smoke") if c.id == cid)
        tensors = materialize(case, "cpu")
        truth = take_snapshot(load("reference").api, case, tensors, upcast=True)
        with impl.parallel(n):
            prod = take_snapshot(impl.api, case, tensors, context=impl.context("emulated"))
        model = case.layout.num_real_rows / cpm.partition(case.layout.total_tokens, n, case.config).total
        ratio = float(prod["indexer_loss"].double() / truth["indexer_loss"])
        assert ratio == pytest.approx(model, rel=4e-3 if case.dtype == "bfloat16" else 1e-6), (cid, n)
        assert model < 0.9  # negative control: the deviation is not within the loss's own noise


@needs_megatron
def test_the_cp_oracle_passes_at_head_and_compares_every_tensor():
    from cases.suites import load_suite
    from parity.engine import RunOptions
    from parity.impls import load
    from parity.oracles.metamorphic import run_oracle

    impl = load("megatron")
    cases = {c.id: c for c in load_suite("smoke")}
    for cid in ("ab101a5d94c2", "140993f2140a", "51ed1802b744"):
        options = RunOptions(impl="megatron", provider="unfused", device="cpu", cp=2)
        with impl.parallel(2):
            r = run_oracle("cp", cases[cid], impl, options)
        assert r.outcome == "pass", (cid, r.message)
        compared = [t for t in r.tensors if t.rule != "baseline"]
        assert compared and all(t.name.startswith("cp2:") for t in r.tensors)
        assert any(t.name == "cp2:grad/hidden" or t.name == "cp2:grad/query" for t in compared)


@needs_megatron
@pytest.mark.slow
def test_every_cp_mutant_is_killed_and_fails_the_cp_oracle():
    """Each CP mutant in a fresh process with its own rank pool (about 45 s each on 2 shared cores, hence slow):
    killed by the CP smoke on every provider that runs its code, and the cp oracle fails on it; on the clean tree
    the same cases pass and the oracle passes (the clean line)."""
    from adapters.megatron import source as src
    from parity.mutation import megatron_mutants as mutants

    names = [m.name for m in mutants.MUTANTS if m.cp > 1]
    lines = []
    outcomes = mutants.run_suite(src.locate().root, names, echo=lines.append)
    assert lines[0].startswith("clean:") and "not clean" not in lines[0], lines[0]
    assert len(outcomes) == len(names) >= 3
    for o in outcomes:
        m = next(m for m in mutants.MUTANTS if m.name == o.name)
        assert o.status == "killed" and set(o.provider.split(",")) == set(m.providers), "\n".join(lines)
        assert o.oracle == "fail", (o.name, "\n".join(lines))
