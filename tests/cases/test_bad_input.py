"""Malformed case specs raise one CaseError naming the offending field — never a torch or Python traceback."""

import copy
import json

import pytest

from cases import Case, CaseError
from cases.packing import Segment, build_layout
from cases.profiles import TINY_CONFIG

BASE = Case(config=TINY_CONFIG.replace(compress_ratio=4),
            layout=build_layout([Segment(9, 12), Segment(5, 5)], slack=2, capacity=5)).to_dict()


def setter(*path_and_value):
    *path, value = path_and_value

    def mutate(d):
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value
    return mutate


def remover(*path):
    def mutate(d):
        for key in path[:-1]:
            d = d[key]
        del d[path[-1]]
    return mutate


# (mutation, field named by the error)
BAD = {
    "unknown case field": (setter("colour", 1), "colour"),
    "dtype unknown": (setter("dtype", "float16"), "dtype"),
    "dtype list": (setter("dtype", ["float64"]), "dtype"),
    "scope": (setter("scope", "block"), "scope"),
    "training string": (setter("training", "yes"), "training"),
    "seed negative": (setter("seed", -1), "seed"),
    "seed float": (setter("seed", 1.5), "seed"),
    "device": (setter("device", "tpu"), "device"),
    "tags": (setter("tags", "x"), "tags"),
    "config missing": (remover("config"), "config"),
    "config list": (setter("config", []), "config"),
    "config unknown field": (setter("config", "heads", 4), "config.heads"),
    "config missing field": (remover("config", "hidden_size"), "config.hidden_size"),
    "config int as string": (setter("config", "hidden_size", "64"), "config.hidden_size"),
    "config int as float": (setter("config", "num_attention_heads", 4.0), "config.num_attention_heads"),
    "config bool as int": (setter("config", "csa_dense_mode", 1), "config.csa_dense_mode"),
    "config nan": (setter("config", "dsa_indexer_loss_coeff", float("nan")), "config.dsa_indexer_loss_coeff"),
    "config negative eps": (setter("config", "layernorm_epsilon", -1e-6), "config.layernorm_epsilon"),
    "config ratio": (setter("config", "compress_ratio", 2), "config.compress_ratio"),
    "config heads vs groups": (setter("config", "num_attention_heads", 3), "config.o_groups"),
    "config zero window": (setter("config", "csa_window_size", 0), "config.csa_window_size"),
    "config indexer dim": (setter("config", "dsa_indexer_head_dim", 48), "config.dsa_indexer_head_dim"),
    "config dense mode at r=0": (lambda d: d["config"].update(csa_dense_mode=True, compress_ratio=0),
                                 "config.csa_dense_mode"),
    "layout missing": (remover("layout"), "layout"),
    "layout kind": (setter("layout", "kind", "sbhd"), "layout.kind"),
    "layout kind list": (setter("layout", "kind", ["thd"]), "layout.kind"),
    "layout unknown field": (setter("layout", "batch", 2), "layout.batch"),
    "cu_seqlens non-monotone": (setter("layout", "cu_seqlens", [0, 9, 7]), "layout.cu_seqlens[2]"),
    "cu_seqlens_padded non-monotone": (setter("layout", "cu_seqlens_padded", [0, 12, 11]),
                                       "layout.cu_seqlens_padded[2]"),
    "cu_seqlens not starting at 0": (setter("layout", "cu_seqlens", [1, 9, 14]), "layout.cu_seqlens[0]"),
    "cu_seqlens string": (setter("layout", "cu_seqlens", "0,9,14"), "layout.cu_seqlens"),
    "cu_seqlens element": (setter("layout", "cu_seqlens", [0, "9", 14]), "layout.cu_seqlens[1]"),
    "cu_seqlens length": (setter("layout", "cu_seqlens", [0, 9]), "layout.cu_seqlens"),
    "real longer than padded": (setter("layout", "cu_seqlens", [0, 13, 14]), "layout.cu_seqlens"),
    "lengths exceed the buffer": (setter("layout", "total_tokens", 10), "layout.total_tokens"),
    "total_tokens string": (setter("layout", "total_tokens", "19"), "layout.total_tokens"),
    "capacity below the true rows": (setter("layout", "compressed_capacity", 3), "layout.compressed_capacity"),
    "capacity negative": (setter("layout", "compressed_capacity", -1), "layout.compressed_capacity"),
    "no real token": (lambda d: d["layout"].update(cu_seqlens=[0, 0, 0]), "layout.cu_seqlens"),
    "bshd zero batch": (setter("layout", {"kind": "bshd", "batch": 0, "seq_len": 4}), "layout.batch"),
    "bshd missing seq_len": (setter("layout", {"kind": "bshd", "batch": 1}), "layout.seq_len"),
}


def test_the_base_spec_is_valid():
    # negative control: the errors below come from the mutations, not from the base spec
    case = Case.from_dict(copy.deepcopy(BASE))
    assert case.layout.compressed_capacity == 5 and case.loss_mode == "sparse"


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_spec_names_the_field(name):
    mutate, field = BAD[name]
    data = copy.deepcopy(BASE)
    mutate(data)
    with pytest.raises(CaseError) as err:
        Case.from_dict(data)
    assert err.value.field == field, str(err.value)
    assert str(err.value).startswith(f"{field}: ")
    # the same through the JSON entry point (what `--case JSON` uses); NaN is not JSON
    if name != "config nan":
        with pytest.raises(CaseError) as err:
            Case.from_json(json.dumps(data))
        assert err.value.field == field


@pytest.mark.parametrize("text", ["", "{", "[]", "null", "3", '"case"'])
def test_not_an_object(text):
    with pytest.raises(CaseError) as err:
        Case.from_json(text)
    assert err.value.field == "case"


def test_top_k_larger_than_the_capacity_is_allowed():
    # K > number of compressed rows is not an error: rows get min(K, #valid) entries (ARCHITECTURE.md)
    data = copy.deepcopy(BASE)
    data["config"]["dsa_indexer_topk"] = 64
    assert Case.from_dict(data).config.dsa_indexer_topk > data["layout"]["compressed_capacity"]
