"""Deterministic materialisation of a case's tensors, and the parameter names/shapes of the layer (spec §1.2).

Every tensor starts from the counter-based draw of :mod:`cases.draws` (seed key ``"{seed}/{name}"``), made on the
device the case runs on, then scaled (parameters: :func:`initial_value`) and cast to its dtype, block by block. The
draw of an element depends only on the case seed, the tensor's name and the element's index: the same case gives
bit-identical tensors on every run, device (CPU or CUDA), thread count and machine, and adding a tensor never
changes the others.

The generator changed once (issue 33): until 2026-12-04 each tensor was a CPU ``torch.Generator`` (mt19937) float64
normal draw, copied to the device. Results and baselines made before then hold other values for the same case id
(:data:`cases.draws.GENERATOR` names the current one; runs record it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from .case import Case
from .config import ModelConfig
from .draws import BLOCK, standard_normal
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


#: Scale of the output gradient on padding rows of a ``padding_dout="poison"`` case (and of the poisoned-dO oracle):
#: large enough that any leak of it dwarfs every rounding difference.
DOUT_POISON = 1e6

def _randn(seed: int, name: str, shape: tuple, dtype: torch.dtype = torch.float64,
           device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """The draw of tensor ``name`` (:mod:`cases.draws`), shaped ``shape``, in ``dtype`` on ``device``."""
    return standard_normal(seed, name, math.prod(shape), device).view(shape).to(dtype)


def _scaled(name: str, shape: tuple, x: torch.Tensor) -> torch.Tensor:
    """A parameter's initial value from its standard-normal draw ``x`` (elementwise, so per chunk or not alike)."""
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return 1.0 + 0.1 * x
    if name.endswith("attn_sink"):
        return x  # O(1) sink logits: the sink takes a real share of the softmax
    if name.endswith(".ape"):
        return 0.5 * x
    return x * shape[-1] ** -0.5  # linear weights: unit-variance outputs


def initial_value(seed: int, name: str, shape: tuple, draw: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Initial value of parameter ``name``, in its draw dtype: scales chosen so every branch of the math is exercised.
    Cast to the parameter's dtype, it is the parameter :func:`materialize` gives.
    ``draw``: the parameter's standard-normal draw when already made."""
    x = _randn(seed, name, shape) if draw is None else draw
    return _scaled(name, shape, x)


@dataclass(frozen=True)
class _Draw:
    """One tensor of a case to draw: seed key ``name``, final ``dtype``, and ``finish(x, a, b)``: the final values
    of its flattened elements ``[a, b)`` from their draw ``x`` (elementwise; None: ``x`` itself)."""

    name: str
    shape: tuple
    dtype: torch.dtype
    finish: Optional[Callable[[torch.Tensor, int, int], torch.Tensor]] = None


def _draw_all(seed: int, draws: list[_Draw], device: Union[str, torch.device] = "cpu") -> dict[str, torch.Tensor]:
    """``{d.name: final tensor on device}``: each tensor drawn, finished and cast block by block straight into its
    slice of the output, so only one block's float64 draw exists at a time. ``finish`` is elementwise, so this gives
    the values of drawing, finishing and casting the whole tensor at once."""
    device = torch.device(device)
    block = BLOCK.get(device.type, BLOCK["cuda"]) * 16
    outs = {}
    for d in draws:
        out = torch.empty(d.shape, dtype=d.dtype, device=device)
        flat = out.view(-1)
        for a in range(0, flat.numel(), block):
            b = min(flat.numel(), a + block)
            x = standard_normal(seed, d.name, b - a, device, start=a)
            flat[a:b] = x if d.finish is None else d.finish(x, a, b)
        outs[d.name] = out
    return outs


def _row_mask(real: torch.Tensor, shape: tuple, a: int, b: int) -> torch.Tensor:
    """``real`` (over the leading dims of ``shape``) for the flattened elements ``[a, b)`` of a tensor of ``shape``."""
    per_row = math.prod(shape[real.dim():])
    r0, r1 = a // per_row, -(-b // per_row)
    return real.reshape(-1)[r0:r1].repeat_interleave(per_row)[a - r0 * per_row:b - r0 * per_row]


@dataclass
class CaseTensors:
    """Everything an implementation needs to run a case, and the seeded output gradient.

    * ``params``: name → leaf tensor with ``requires_grad=True`` (production names).
    * ``inputs``: ``{"hidden"}`` (layer scope) or ``{"query", "kv", "hidden", "q_latent"}`` (core scope), leaves with
      ``requires_grad=True``. BSHD shapes ``[B,S,...]``, THD ``[T,...]``:
      hidden ``[..., Hd]``, query ``[..., n, D]``, kv ``[..., D]``, q_latent ``[..., Rq]``.
    * ``grad_output``: dO, shaped like the output (layer ``[..., Hd]``, core ``[..., n, D]``). On non-real THD rows
      it is zero at layer scope (a real training loss masks them) and random at core scope, so the implementation's
      own masking of padding-row dO is exercised; ``padding_dout="poison"`` cases get ``DOUT_POISON`` times a random
      draw there at either scope.
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


def padding_dout_scale(case: Case, padding_scale: float = 1.0) -> float:
    """The factor of the standard-normal draw of dO on non-real rows: 0 at layer scope, ``padding_scale`` at core
    scope, ``DOUT_POISON`` for a ``padding_dout="poison"`` case."""
    if case.padding_dout == "poison":
        return DOUT_POISON
    return 0.0 if case.scope == "layer" else padding_scale


def materialize(case: Case, device: Union[str, torch.device] = "cpu", *,
                padding_scale: float = 1.0, dout_padding_scale: Optional[float] = None) -> CaseTensors:
    """Build the case's tensors on ``device``.

    ``padding_scale`` multiplies the values of non-real rows (padding and slack) of every input: the padding-invariance
    checks set it large ("poison") and expect real-row results to be bit-identical. ``dout_padding_scale`` overrides
    :func:`padding_dout_scale` (the factor of dO on non-real rows; 0 gives zeros).
    """
    dtype = case.torch_dtype
    if isinstance(case.layout, ThdLayout):
        kinds = case.layout.row_kinds()
        real = torch.tensor([k == "real" for k in kinds], dtype=torch.bool)
        psp = case.layout.packed_seq_params(case.config.compress_ratio, device=device)
    else:
        kinds = []
        real = torch.ones(_token_shape(case), dtype=torch.bool)
        psp = None
    all_real = bool(real.all())
    real = real.to(device)

    def param(name: str, shape: tuple) -> _Draw:
        param_dtype = torch.float32 if (dtype == torch.bfloat16 and name in FP32_PARAMETERS) else dtype
        return _Draw(name, shape, param_dtype, lambda x, a, b: _scaled(name, shape, x))

    def rows_scaled(name: str, shape: tuple, scale: float = padding_scale) -> _Draw:  # non-real rows times scale
        if scale == 1.0 or all_real:
            return _Draw(name, shape, dtype)
        return _Draw(name, shape, dtype, lambda x, a, b: torch.where(_row_mask(real, shape, a, b), x, x * scale))

    def rows_zeroed(name: str, shape: tuple) -> _Draw:  # layer-scope dO: zero on non-real rows
        if all_real:
            return _Draw(name, shape, dtype)
        return _Draw(name, shape, dtype, lambda x, a, b: x * _row_mask(real, shape, a, b).to(x.dtype))

    shapes = parameter_shapes(case.config, case.scope)
    draws = [param(name, shape) for name, shape in shapes.items()]
    draws += [rows_scaled(f"input/{name}", shape) for name, shape in input_shapes(case).items()]
    dout_scale = padding_dout_scale(case, padding_scale) if dout_padding_scale is None else dout_padding_scale
    draws.append(rows_zeroed("grad_output", output_shape(case)) if dout_scale == 0.0 else
                 rows_scaled("grad_output", output_shape(case), dout_scale))
    values = _draw_all(case.seed, draws, device)
    params = {name: values[name].requires_grad_(True) for name in shapes}
    inputs = {name: values[f"input/{name}"].requires_grad_(True) for name in input_shapes(case)}
    return CaseTensors(params=params, inputs=inputs, grad_output=values["grad_output"],
                       packed_seq_params=psp, real_rows=real, row_kinds=kinds)


def api_inputs(case: Case, tensors: CaseTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden, q_latent)`` for the public ``compressor`` / ``indexer`` on a case (``[B, S, ...]`` / ``[T, ...]``):
    the case's own inputs at core scope; at layer scope its ``hidden`` and a ``q_latent`` drawn like an input
    (seed key ``"api/q_latent"``, so no other tensor changes)."""
    hidden = tensors.inputs["hidden"].detach()
    if "q_latent" in tensors.inputs:
        return hidden, tensors.inputs["q_latent"].detach()
    shape = _token_shape(case) + (case.config.q_lora_rank,)
    q_latent = _randn(case.seed, "api/q_latent", shape, case.torch_dtype, hidden.device)
    return hidden, q_latent
