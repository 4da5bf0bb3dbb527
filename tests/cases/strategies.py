"""Hypothesis strategies for cases: arbitrary valid configs and layouts (not only what the generator draws)."""

from hypothesis import strategies as st

from cases import BshdLayout, Case
from cases.packing import Segment, build_layout, capacity_for
from cases.profiles import TINY_CONFIG

segments = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 6)).map(lambda rp: Segment(rp[0], rp[0] + rp[1])),
    min_size=1, max_size=6,
).filter(lambda segs: any(s.real for s in segs))


@st.composite
def thd_layouts(draw, ratio=4):
    segs = draw(segments)
    slack = draw(st.integers(0, 5))
    plain = build_layout(segs, slack=slack)
    cap = capacity_for(plain, ratio, draw(st.sampled_from(["none", "exact", "production", "over"])),
                       extra=draw(st.integers(1, 4)))
    return build_layout(segs, slack=slack, capacity=cap)


@st.composite
def configs(draw):
    ratio = draw(st.sampled_from([0, 4, 128]))
    n = draw(st.sampled_from([2, 4, 8]))
    return TINY_CONFIG.replace(
        compress_ratio=ratio, num_attention_heads=n,
        csa_window_size=draw(st.integers(1, 32)), dsa_indexer_topk=draw(st.integers(1, 16)),
        csa_dense_mode=ratio == 4 and draw(st.booleans()),
        dsa_indexer_use_sparse_loss=draw(st.booleans()), calculate_per_token_loss=draw(st.booleans()),
        dsa_indexer_loss_coeff=draw(st.floats(1e-4, 1.0, allow_nan=False)),
        rotary_base=draw(st.floats(1.0, 1e6, allow_nan=False)))


@st.composite
def cases(draw):
    config = draw(configs())
    if draw(st.booleans()):
        layout = BshdLayout(draw(st.integers(1, 4)), draw(st.integers(1, 64)))
    else:
        layout = draw(thd_layouts(config.compress_ratio))
    return Case(config=config, layout=layout, dtype=draw(st.sampled_from(["float64", "float32", "bfloat16"])),
                training=draw(st.booleans()), scope=draw(st.sampled_from(["layer", "core"])),
                seed=draw(st.integers(0, 2 ** 63 - 1)), device=draw(st.sampled_from(["any", "cuda"])),
                profile=draw(st.sampled_from(["tiny", "kernel", "custom"])),
                tags=tuple(draw(st.lists(st.text(max_size=8), max_size=3))))
