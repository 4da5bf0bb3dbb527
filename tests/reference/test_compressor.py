"""KV compressor (spec §2): gated per-channel softmax pooling, r=4 overlap, tail drop, norm, RoPE at g*r, Hadamard."""

from __future__ import annotations

import pytest
import torch

from cases.errors import CaseError
from reference import compressor
from reference.compressor import ATTENTION_PREFIX, INDEXER_PREFIX, compress_sequence
from reference.hadamard import hadamard_matrix
from reference.rope import layer_inv_freq

from .helpers import case_of, materialized, thd_layout, tiny_config
from .test_rope_norm_hadamard import complex_rope_oracle


def weights(ratio: int, d: int, hidden: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    coff = 2 if ratio == 4 else 1
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    return dict(wkv=rnd(coff * d, hidden) / 4, wgate=rnd(coff * d, hidden) / 4, ape=rnd(ratio, coff * d),
                norm_weight=1 + 0.1 * rnd(d))


def oracle(x, wkv, wgate, ape, norm_weight, *, ratio, d, inv_freq, eps=1e-6, rotate=False, ape_after_shift=False):
    """Loop over entries and pooled positions of one sequence ``x [L, Hd]`` (vectorised over channels)."""
    entries = []
    for g in range(x.shape[0] // ratio):
        slots = []  # (token, channel half, ape row)
        if ratio == 4:
            if g > 0:
                slots += [((g - 1) * ratio + p, 0, p) for p in range(ratio)]
            slots += [(g * ratio + p, 1, p) for p in range(ratio)]
        else:
            slots += [(g * ratio + p, 0, p) for p in range(ratio)]
        kv = torch.stack([x[t] @ wkv[h * d:(h + 1) * d].T for t, h, _ in slots])
        ape_half = (lambda h: 1 - h) if ape_after_shift and ratio == 4 else (lambda h: h)
        score = torch.stack([x[t] @ wgate[h * d:(h + 1) * d].T + ape[p, ape_half(h) * d:(ape_half(h) + 1) * d]
                             for t, h, p in slots])
        pooled = (torch.softmax(score, dim=0) * kv).sum(0)
        normed = pooled / torch.sqrt((pooled ** 2).mean() + eps) * norm_weight
        roped = complex_rope_oracle(normed, torch.tensor(g * ratio), inv_freq, 2 * inv_freq.numel())
        entries.append(roped @ hadamard_matrix(d) / d ** 0.5 if rotate else roped)
    return torch.stack(entries) if entries else x.new_zeros(0, d)


@pytest.mark.parametrize("ratio,rotate,length", [(4, False, 23), (4, True, 16), (128, False, 300)])
def test_compressor_matches_loop_oracle(ratio, rotate, length):
    config = tiny_config(ratio)
    d, hidden = 16, config.hidden_size
    w = weights(ratio, d, hidden)
    x = torch.randn(2, length, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    inv = layer_inv_freq(config)
    got = compress_sequence(x, **w, ratio=ratio, head_dim=d, inv_freq=inv, eps=1e-6, rotate=rotate)
    assert got.shape == (2, length // ratio, d)
    for b in range(2):
        want = oracle(x[b], **w, ratio=ratio, d=d, inv_freq=inv, rotate=rotate)
        assert torch.allclose(got[b], want, rtol=0, atol=1e-13)
        if ratio == 4:  # negative control: ape applied after the overlap shift is a different compressor
            wrong = oracle(x[b], **w, ratio=ratio, d=d, inv_freq=inv, rotate=rotate, ape_after_shift=True)
            assert not torch.allclose(got[b], wrong, atol=1e-6)


@pytest.mark.parametrize("ratio", [4, 128])
def test_tail_is_dropped_and_entries_are_causal(ratio):
    config = tiny_config(ratio)
    w = weights(ratio, 16, config.hidden_size)
    L = 2 * ratio + ratio // 2 + 1
    x = torch.randn(1, L, config.hidden_size, dtype=torch.float64)
    run = lambda t: compress_sequence(t, **w, ratio=ratio, head_dim=16, inv_freq=layer_inv_freq(config), eps=1e-6,
                                      rotate=False)
    base = run(x)
    assert base.shape[1] == 2
    y = x.clone()
    y[:, 2 * ratio:] += 100.0  # the tail
    assert torch.equal(run(y), base)
    z = x.clone()
    z[:, ratio + 1] += 1.0  # a token of block 1 changes entry 1 (and entry 2 of r=4, dropped here), never entry 0
    changed = run(z)
    assert torch.equal(changed[:, 0], base[:, 0]) and not torch.allclose(changed[:, 1], base[:, 1])
    assert run(x[:, : ratio - 1]).shape == (1, 0, 16)


def test_thd_compressor_packs_segments_and_capacity():
    config = tiny_config(4)
    layout = thd_layout([5, 0, 9, 3], [8, 0, 12, 3], slack=2, capacity=9)
    t = materialized(case_of(config, layout))
    hidden = t.inputs["hidden"].detach()
    psp = t.packed_seq_params
    for prefix, rotate, d in ((ATTENTION_PREFIX, False, 16), (INDEXER_PREFIX, True, 16)):
        packed = compressor(hidden, t.params, prefix, config, psp, rotate=rotate)
        assert packed.shape == (9, d)  # true rows 2 + 0 + 3 + 0 = 5, capacity 9
        pieces = [compressor(hidden[a:b].unsqueeze(0), t.params, prefix, config, rotate=rotate)[0]
                  for a, b in ((0, 8), (8, 8), (8, 20), (20, 23))]
        assert torch.equal(packed[:5], torch.cat(pieces))
    psp.total_comp_capacity = None
    assert compressor(hidden, t.params, ATTENTION_PREFIX, config, psp).shape == (5, 16)
    psp.total_comp_capacity = 4  # negative control: too small a capacity is an error naming the field
    with pytest.raises(CaseError, match="total_comp_capacity"):
        compressor(hidden, t.params, ATTENTION_PREFIX, config, psp)
    with pytest.raises(CaseError, match="prefix"):
        compressor(hidden[None], t.params, "core_attention.bogus", config)


@pytest.mark.parametrize("ratio,rotate,length", [(4, True, 9), (4, False, 12), (128, False, 129)])
def test_gradcheck_compressor(ratio, rotate, length):
    d, hidden = 8, 4
    config = tiny_config(ratio, v_head_dim=8, qk_pos_emb_head_dim=4, hidden_size=hidden)
    w = {k: v.requires_grad_(True) for k, v in weights(ratio, d, hidden).items()}
    x = torch.randn(1, length, hidden, dtype=torch.float64, requires_grad=True)
    inv = layer_inv_freq(config)
    fn = lambda x, wkv, wgate, ape, nw: compress_sequence(x, wkv, wgate, ape, nw, ratio=ratio, head_dim=d,
                                                          inv_freq=inv, eps=1e-6, rotate=rotate)
    assert torch.autograd.gradcheck(fn, (x, w["wkv"], w["wgate"], w["ape"], w["norm_weight"]),
                                    fast_mode=ratio == 128)
