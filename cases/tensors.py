"""Deterministic materialisation of a case's tensors, and the parameter names/shapes of the layer (spec §1.2).

Every tensor is drawn in float64 on the CPU from its own generator, seeded by ``(case.seed, tensor name)``, then cast
to the case dtype and moved to the device: the same case gives bit-identical tensors on every run and every machine
of the same device type, and adding a tensor never changes the others.
"""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from .case import Case
from .config import ModelConfig
from .layout import BshdLayout, PackedSeqParams, ThdLayout

# Parameters production keeps in fp32 whatever the activation dtype (``mark_keep_in_fp32``).
FP32_PARAMETERS = ("core_attention.attn_sink", "core_attention.compressor.ape", "core_attention.indexer.compressor.ape")


def compressor_parameter_shapes(prefix: str, ratio: int, head_dim: int, coff: int, hidden: int) -> dict[str, tuple]:
    return {
        f"{prefix}.linear_wkv.weight": (coff * head_dim, hidden),
        f"{prefix}.linear_wgate.weight": (coff * head_dim, hidden),
        f"{prefix}.ape": (ratio, coff * head_dim),
        f"{prefix}.norm.weight": (head_dim,),
    }


def core_parameter_shapes(config: ModelConfig) -> dict[str, tuple]:
    """``core_attention.*`` parameters: sink, attention compressor (r>1), indexer (r=4, not dense mode)."""
    c = config
    shapes: dict[str, tuple] = {"core_attention.attn_sink": (c.num_attention_heads,)}
    if c.has_compressor:
        shapes.update(compressor_parameter_shapes("core_attention.compressor", c.compress_ratio, c.v_head_dim,
                                                  c.coff, c.hidden_size))
    if c.has_indexer:
        nI, dI = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
        shapes["core_attention.indexer.linear_wq_b.weight"] = (nI * dI, c.q_lora_rank)
        shapes["core_attention.indexer.linear_weights_proj.weight"] = (nI, c.hidden_size)
        shapes.update(compressor_parameter_shapes("core_attention.indexer.compressor", 4, dI, 2, c.hidden_size))
    return shapes


def layer_parameter_shapes(config: ModelConfig) -> dict[str, tuple]:
    """Every parameter of ``DSv4HybridAttention`` by its ``named_parameters()`` name (qk_layernorm=True)."""
    c = config
    n, D, Hd, Rq, G, Ro = (c.num_attention_heads, c.v_head_dim, c.hidden_size, c.q_lora_rank, c.o_groups,
                           c.o_lora_rank)
    shapes = {
        "linear_q_down_proj.weight": (Rq, Hd),
        "q_layernorm.weight": (Rq,),
        "linear_q_up_proj.weight": (n * D, Rq),
        "linear_kv_proj.weight": (D, Hd),
        "kv_layernorm.weight": (D,),
        "linear_o_group_proj": (G * Ro, n * D // G),
        "linear_proj.weight": (Hd, G * Ro),
    }
    shapes.update(core_parameter_shapes(config))
    return shapes


def parameter_shapes(config: ModelConfig, scope: str) -> dict[str, tuple]:
    return layer_parameter_shapes(config) if scope == "layer" else core_parameter_shapes(config)


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2 ** 63 - 1))


def _randn(seed: int, name: str, shape: tuple) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(seed, name), dtype=torch.float64)


def _draw_all(seed: int, shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """``{name: _randn(seed, name, shape)}``. Every draw has its own generator, so drawing them on several threads
    (``torch.get_num_threads()`` of them, the run's intra-op budget) gives the very same values as one after the
    other; at kernel-profile shapes the float64 draws (~40 M numbers) were most of a GPU case's harness time."""
    threads = min(torch.get_num_threads(), len(shapes))
    if threads <= 1 or sum(math.prod(s) for s in shapes.values()) < 1 << 20:
        return {name: _randn(seed, name, shape) for name, shape in shapes.items()}
    with ThreadPoolExecutor(threads) as pool:
        futures = {name: pool.submit(_randn, seed, name, shape) for name, shape in shapes.items()}
        return {name: f.result() for name, f in futures.items()}


def initial_value(seed: int, name: str, shape: tuple, draw: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 initial value of parameter ``name``: scales chosen so every branch of the math is exercised.
    ``draw``: the parameter's standard-normal draw when already made (:func:`_draw_all`)."""
    x = _randn(seed, name, shape) if draw is None else draw
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return 1.0 + 0.1 * x
    if name.endswith("attn_sink"):
        return x  # O(1) sink logits: the sink takes a real share of the softmax
    if name.endswith(".ape"):
        return 0.5 * x
    return x * shape[-1] ** -0.5  # linear weights: unit-variance outputs


@dataclass
class CaseTensors:
    """Everything an implementation needs to run a case, and the seeded output gradient.

    * ``params``: name → leaf tensor with ``requires_grad=True`` (production names).
    * ``inputs``: ``{"hidden"}`` (layer scope) or ``{"query", "kv", "hidden", "q_latent"}`` (core scope), leaves with
      ``requires_grad=True``. BSHD shapes ``[B,S,...]``, THD ``[T,...]``:
      hidden ``[..., Hd]``, query ``[..., n, D]``, kv ``[..., D]``, q_latent ``[..., Rq]``.
    * ``grad_output``: dO, shaped like the output (layer ``[..., Hd]``, core ``[..., n, D]``). At layer scope it is
      zero on non-real THD rows (a real training loss masks them); at core scope it is random there too, so the
      implementation's own masking of padding-row dO is exercised.
    * ``packed_seq_params``: THD runtime metadata, else None.
    * ``real_rows``: bool mask over rows (``[B,S]`` or ``[T]``) of real tokens.
    """

    params: dict[str, torch.Tensor]
    inputs: dict[str, torch.Tensor]
    grad_output: torch.Tensor
    packed_seq_params: Optional[PackedSeqParams]
    real_rows: torch.Tensor
    row_kinds: list = field(default_factory=list)


def _token_shape(case: Case) -> tuple:
    layout = case.layout
    return (layout.batch, layout.seq_len) if isinstance(layout, BshdLayout) else (layout.total_tokens,)


def input_shapes(case: Case) -> dict[str, tuple]:
    c, rows = case.config, _token_shape(case)
    if case.scope == "layer":
        return {"hidden": rows + (c.hidden_size,)}
    return {"query": rows + (c.num_attention_heads, c.v_head_dim), "kv": rows + (c.v_head_dim,),
            "hidden": rows + (c.hidden_size,), "q_latent": rows + (c.q_lora_rank,)}


def output_shape(case: Case) -> tuple:
    c, rows = case.config, _token_shape(case)
    return rows + ((c.hidden_size,) if case.scope == "layer" else (c.num_attention_heads, c.v_head_dim))


def materialize(case: Case, device: Union[str, torch.device] = "cpu", *,
                padding_scale: float = 1.0) -> CaseTensors:
    """Build the case's tensors on ``device``.

    ``padding_scale`` multiplies the values of non-real rows (padding and slack) of every input: the padding-invariance
    checks set it large ("poison") and expect real-row results to be bit-identical.
    """
    dtype = case.torch_dtype
    shapes = parameter_shapes(case.config, case.scope)
    draws = _draw_all(case.seed, {**shapes, **{f"input/{n}": s for n, s in input_shapes(case).items()},
                                  "grad_output": output_shape(case)})
    params = {}
    for name, shape in shapes.items():
        value = initial_value(case.seed, name, shape, draws[name])
        param_dtype = torch.float32 if (dtype == torch.bfloat16 and name in FP32_PARAMETERS) else dtype
        params[name] = value.to(param_dtype).to(device).requires_grad_(True)

    if isinstance(case.layout, ThdLayout):
        kinds = case.layout.row_kinds()
        real = torch.tensor([k == "real" for k in kinds], dtype=torch.bool)
        psp = case.layout.packed_seq_params(case.config.compress_ratio, device=device)
    else:
        kinds = []
        real = torch.ones(_token_shape(case), dtype=torch.bool)
        psp = None

    def rows_scaled(x: torch.Tensor) -> torch.Tensor:
        if padding_scale == 1.0 or bool(real.all()):
            return x
        mask = real.reshape(real.shape + (1,) * (x.dim() - real.dim()))
        return torch.where(mask, x, x * padding_scale)

    inputs = {name: rows_scaled(draws[f"input/{name}"]).to(dtype).to(device).requires_grad_(True)
              for name in input_shapes(case)}
    d_out = draws["grad_output"]
    if case.scope == "layer":
        d_out = d_out * real.reshape(real.shape + (1,)).to(d_out.dtype)
    else:
        d_out = rows_scaled(d_out)
    return CaseTensors(params=params, inputs=inputs, grad_output=d_out.to(dtype).to(device), packed_seq_params=psp,
                       real_rows=real.to(device), row_kinds=kinds)
