"""THD packing = concatenation of independent sequences (spec §6.5 invariant 1), outputs and all gradients.

A packed batch (zero-length segments, segments shorter than r and than the window, lengths that are not multiples
of r, slack rows) must equal running each segment alone as BSHD B=1 and concatenating, to 1e-12 in float64. With
the mean loss, the packed loss is ``sum_b loss_b * L_b / N`` (each BSHD loss is a mean over its own L_b rows).
"""

from __future__ import annotations

import pytest
import torch

from reference import attention_layer, core_attention

from .helpers import case_of, materialized, run_with_grads, thd_layout, tiny_config

TOL = 1e-12
LENGTHS = {0: [0, 3, 11, 17, 0, 9], 4: [0, 3, 11, 17, 0, 9], 128: [3, 130, 0, 131]}
CONFIGS = {"r0": tiny_config(0), "r4_sparse": tiny_config(4), "r4_dense": tiny_config(4, sparse=False),
           "r4_sparse_per_token": tiny_config(4, per_token=True), "r128": tiny_config(128)}


def per_segment_reference(case, tensors, lengths, *, positions_reset=True):
    """Run every segment alone as BSHD B=1; return the packed-equivalent outputs, loss and gradients."""
    impl = attention_layer if case.scope == "layer" else core_attention
    config = case.config
    total_real = sum(lengths)
    bounds = [0]
    for L in lengths:
        bounds.append(bounds[-1] + L)
    if not positions_reset:  # negative control: the whole buffer as one sequence
        bounds, lengths = [0, bounds[-1]], [bounds[-1]]
    out_rows, lse_rows, loss = [], [], 0.0
    grads = {f"grad/{n}": torch.zeros_like(v) for n, v in {**tensors.inputs, **tensors.params}.items()}
    for b, L in enumerate(lengths):
        if L == 0:
            continue
        rows = slice(bounds[b], bounds[b + 1])
        inputs = {n: v.detach()[rows].unsqueeze(0).clone().requires_grad_(True) for n, v in tensors.inputs.items()}
        params = {n: v.detach().clone().requires_grad_(True) for n, v in tensors.params.items()}
        names = ("hidden",) if case.scope == "layer" else ("query", "kv", "hidden", "q_latent")
        args = [inputs[k] for k in names]
        res = impl(*args, params, config)
        weight = 1.0 if config.calculate_per_token_loss else L / total_real
        objective = (res.out * tensors.grad_output[rows].unsqueeze(0)).sum()
        if res.indexer_loss is not None:
            objective = objective + res.indexer_loss * weight
            loss += float(res.indexer_loss.detach()) * weight
        leaves = {**inputs, **params}
        for name, g in zip(leaves, torch.autograd.grad(objective, list(leaves.values()), allow_unused=True)):
            if g is None:
                continue
            if name in inputs:
                grads[f"grad/{name}"][rows] += g[0]
            else:
                grads[f"grad/{name}"] += g
        out_rows.append(res.out.detach()[0])
        lse_rows.append(res.lse.detach()[0])
    return {"out": torch.cat(out_rows), "lse": torch.cat(lse_rows), "loss": loss, **grads}


def mismatches(packed, ref, used_rows, tol=TOL):
    bad = []
    for key in ("out", "lse"):
        err = float((packed[key][:used_rows] - ref[key]).abs().max())
        if not err <= tol:
            bad.append(f"{key}: {err:.3e}")
    if "loss" in packed and not abs(float(packed["loss"]) - ref["loss"]) <= tol:
        bad.append(f"loss: {float(packed['loss'])} vs {ref['loss']}")
    for key in ref:
        if key.startswith("grad/"):
            err = float((packed[key] - ref[key]).abs().max()) if ref[key].numel() else 0.0
            if not err <= tol * max(1.0, float(ref[key].abs().max()) if ref[key].numel() else 1.0):
                bad.append(f"{key}: {err:.3e}")
    return bad


@pytest.mark.parametrize("scope", ["layer", "core"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_equals_concatenated_segments(name, scope):
    config = CONFIGS[name]
    lengths = LENGTHS[config.compress_ratio]
    layout = thd_layout(lengths, slack=3)
    case = case_of(config, layout, scope=scope)
    tensors = materialized(case)
    packed = run_with_grads(attention_layer if scope == "layer" else core_attention, case, tensors)
    used = sum(lengths)
    bad = mismatches(packed, per_segment_reference(case, tensors, lengths), used)
    assert not bad, bad
    # slack rows: out 0, lse -inf, no gradient
    assert bool((packed["out"][used:] == 0).all())
    if scope == "core":
        assert bool(torch.isneginf(packed["lse"][used:]).all())
    for key, value in packed.items():
        if key.startswith("grad/") and key.split("/", 1)[1] in tensors.inputs:
            assert bool((value[used:] == 0).all()), key


@pytest.mark.parametrize("name", ["r4_sparse", "r128"])
def test_negative_control_positions_not_reset_per_segment(name):
    """Treating the packed buffer as one sequence (a planted THD bug) must be caught by the same comparison."""
    config = CONFIGS[name]
    lengths = LENGTHS[config.compress_ratio]
    case = case_of(config, thd_layout(lengths))
    tensors = materialized(case)
    packed = run_with_grads(attention_layer, case, tensors)
    assert mismatches(packed, per_segment_reference(case, tensors, lengths, positions_reset=False), sum(lengths))


def test_single_segment_thd_equals_bshd_b1_bitwise_in_output():
    config = CONFIGS["r4_sparse"]
    t = materialized(case_of(config, thd_layout([23])))
    a = attention_layer(t.inputs["hidden"], t.params, config, t.packed_seq_params)
    b = attention_layer(t.inputs["hidden"].unsqueeze(0), t.params, config)
    assert torch.equal(a.out, b.out[0]) and torch.equal(a.topk_indices, b.topk_indices[0])
    assert float(a.indexer_loss.detach()) == float(b.indexer_loss.detach())


def test_on_host_hands_back_host_offsets_unchanged_and_reports_bad_ones_later():
    """``thd.on_host`` on offsets already on the host is the same object (nothing to read); malformed offsets pass
    through to :func:`thd.segments`, which names the field (control: a valid packing's segments are unchanged)."""
    from cases.errors import CaseError
    from cases.layout import PackedSeqParams
    from reference import thd

    psp = PackedSeqParams(torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32), 4)
    assert thd.on_host(psp) is psp
    assert thd.segments(thd.on_host(psp), 9) == thd.segments(psp, 9)
    bad = PackedSeqParams(torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0.0, 4.0]), 4)
    with pytest.raises(CaseError, match="cu_seqlens_q_padded"):
        thd.segments(thd.on_host(bad), 9)


@pytest.mark.parametrize("scope", ["layer", "core"])
def test_empty_and_short_segments_run_no_sequence_math(scope, monkeypatch):
    """A segment with no rows runs no core attention, and one shorter than the ratio runs no compressor (it has no
    entries): on the GPU each skipped call was hundreds of kernel launches. The values are the per-segment
    definition's (``test_packed_equals_concatenated_segments`` on the same lengths). Control: a pack of segments that
    all have rows and entries makes one call of each per segment, so the counts do see every call."""
    import importlib

    # by module name: the package's own `core_attention` is the public function
    core_mod, compressor_mod = (importlib.import_module(f"reference.{m}") for m in ("core_attention", "compressor"))

    calls = {"core": 0, "compressor": 0}
    core_sequence, compress = core_mod.core_sequence, compressor_mod.compress_with_params

    def counted_core(*args, **kwargs):
        calls["core"] += 1
        return core_sequence(*args, **kwargs)

    def counted_compress(*args, **kwargs):
        calls["compressor"] += 1
        return compress(*args, **kwargs)

    monkeypatch.setattr(core_mod, "core_sequence", counted_core)
    monkeypatch.setattr(compressor_mod, "compress_with_params", counted_compress)
    config = CONFIGS["r4_sparse"]  # a compressor and an indexer compressor, ratio 4
    impl = attention_layer if scope == "layer" else core_attention
    for lengths, core_calls, compressor_calls in (([0, 3, 11, 17, 0, 9], 4, 2 * 3), ([5, 11, 17, 9], 4, 2 * 4)):
        calls.update(core=0, compressor=0)
        case = case_of(config, thd_layout(lengths, slack=3), scope=scope)
        run_with_grads(impl, case, materialized(case))
        assert calls == {"core": core_calls, "compressor": compressor_calls}, (lengths, calls)


@pytest.mark.parametrize("lengths", [[0, 3, 2, 1], [5, 3]], ids=["all-short", "one-compresses"])
def test_compressor_weights_keep_a_gradient_where_no_segment_has_an_entry(lengths):
    """Skipping short segments must not cut the compressors out of the graph: where no segment of the pack reaches
    the ratio, every segment still runs, so the compressor weights (and ``hidden``) get a zero gradient, not none,
    as the rest of the reference does. Control: with one segment that compresses, the weights' gradient is nonzero."""
    config = CONFIGS["r4_sparse"]
    case = case_of(config, thd_layout(lengths, slack=3), scope="core")
    tensors = materialized(case)
    i = tensors.inputs
    res = core_attention(i["query"], i["kv"], i["hidden"], i["q_latent"], tensors.params, config,
                         tensors.packed_seq_params, training=True)
    names = [n for n in tensors.params if ".compressor." in n] + ["hidden"]
    leaves = [tensors.params[n] if n != "hidden" else i["hidden"] for n in names]
    grads = dict(zip(names, torch.autograd.grad(res.objective(tensors.grad_output), leaves, allow_unused=True)))
    assert [n for n, g in grads.items() if g is None] == []
    weights_moved = any(bool(g.abs().sum() > 0) for n, g in grads.items() if n.endswith("linear_wkv.weight"))
    assert weights_moved == (max(lengths) >= config.compress_ratio)
