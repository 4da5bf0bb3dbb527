"""The public API (ARCHITECTURE.md) over production's layer: ``attention_layer`` and ``core_attention`` run
Megatron-LM's ``DSv4HybridSelfAttention`` / its ``core_attention`` (``CompressedSparseAttention``) on the harness's
tensors and return an :class:`~cases.outputs.AttentionOutput` built from production's own tensors.

* Parameters: ``torch.func.functional_call`` with the harness's leaves by production name (``named_parameters()``
  are this project's names), so the harness's leaves receive the gradients.
* Layout: BSHD ``[B, S, ...]`` is transposed to production's ``[S, B, ...]``; THD ``[T, ...]`` gets production's dummy
  batch dim (``[T, 1, ...]``) and a Megatron ``PackedSeqParams`` (real and padded ``cu_seqlens``, ``max_seqlen``).
* The indexer loss is attached by production (``DSAIndexerLossAutoScaler``): its gradient already flows through
  ``out``, so the recorded loss is returned detached (the harness's objective adds its value only).
* Production returns no LSE on the unfused path: ``lse`` is then *not provided* (:data:`NOT_PROVIDED`), never
  recomputed here.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch.func import functional_call

from cases.config import ModelConfig
from cases.errors import CaseError
from cases.layout import PackedSeqParams
from cases.outputs import AttentionOutput

from . import cp, recorders
from .providers import current, run_context

CORE_PREFIX = "core_attention."
INDEXER_PREFIX = "core_attention.indexer."


class MegatronOutput(AttentionOutput):
    """An :class:`AttentionOutput` plus ``not_provided``: ``{tensor name: why production has no such tensor}``."""

    def __init__(self, *args, not_provided: Optional[dict] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.not_provided = dict(not_provided or {})


def _megatron_psp(mg, psp: PackedSeqParams, total: int):
    cls = mg.modules["megatron.core.packed_seq_params"].PackedSeqParams
    cu_real = psp.cu_seqlens_q.to(torch.int32)
    cu_pad = psp.cu_seqlens_q_padded.to(torch.int32)
    return cls(qkv_format="thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real, cu_seqlens_q_padded=cu_pad,
               cu_seqlens_kv_padded=cu_pad, max_seqlen_q=int(psp.max_seqlen_q), max_seqlen_kv=int(psp.max_seqlen_q),
               total_tokens=total)


def _check_split(topk_indices) -> None:
    if topk_indices is not None:
        raise CaseError("topk_indices", "production selects its own top-k; split mode is not available for megatron")


def _rows(t: torch.Tensor, packed: bool) -> torch.Tensor:
    """A harness row tensor (``hidden``, ``q_latent``) in production's layout: THD ``[T, ..]`` -> ``[T, 1, ..]`` (its
    dummy batch dim), BSHD ``[B, S, ..]`` -> ``[S, B, ..]``."""
    return t.unsqueeze(1) if packed else t.transpose(0, 1)


def _core_query_key(query: torch.Tensor, kv: torch.Tensor, packed: bool) -> tuple:
    """The core attention's ``query [.., n, D]`` / ``kv [.., D]`` in production's layout: THD ``[T, n, D]`` and
    ``[T, 1, 1, D]``; BSHD ``[S, B, n, D]`` and ``[S, B, 1, D]`` (its key, which is also its value)."""
    if packed:
        return query, kv.view(-1, 1, 1, kv.shape[-1])
    return query.transpose(0, 1), kv.transpose(0, 1).unsqueeze(2)


#: why THD index scores are missing where production's per-segment THD loops made no top-k call
NO_THD_SCORES = "production's THD indexer ran no per-segment top-k at this revision (no scores to read)"


def _indexer_outputs(record: recorders.Record, config: ModelConfig, packed: Optional[PackedSeqParams],
                     lead: tuple) -> tuple:
    """``(topk_indices, index_scores, not_provided)`` in the contract's layout from what production recorded (None,
    None when production produced none; ``not_provided``: ``{tensor: why}`` for tensors production never surfaces)."""
    k = config.dsa_indexer_topk
    if packed is None:
        topk, scores = record.get("fused_topk", record.get("topk")), record.get("fused_scores", record.get("scores"))
        if topk is None:
            return None, None, {}
        if "fused_topk" not in record:  # unfused: picks of masked keys read -1 (recorders.drop_masked)
            topk = recorders.drop_masked(topk, scores)
        return recorders.contract_topk(topk, k).view(lead + (k,)), scores, {}
    local = record.get("fused_topk", record.get("topk_local"))
    if local is None and record.get("thd_kv_full_ids") is not None:  # kv_full generation (unfused THD)
        local = recorders.thd_kv_full_to_local(record["thd_kv_full_ids"], record["thd_cu_seqlens_q"],
                                               record["thd_cu_seqlens_kv"])
        if record.get("segment_scores") is None:
            return recorders.contract_topk(local, k), None, {"index_scores": NO_THD_SCORES}
        width = int(packed.max_seqlen_q) // config.compress_ratio
        return (recorders.contract_topk(local, k),
                recorders.thd_segment_scores_to_local(record["segment_scores"], width), {})
    if local is None:
        return None, None, {}
    scores = record.get("fused_scores")
    if scores is None and record.get("scores") is not None and record.get("compressed_offsets") is not None:
        width = int(packed.max_seqlen_q) // config.compress_ratio
        scores = recorders.thd_scores_to_local(record["scores"], record["compressed_offsets"], width)
    return recorders.contract_topk(local, k), scores, {}


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The contract's dtype of production's float32 values (its islands) in a case of ``dtype``: float64 for float64
    cases, else float32 (exact either way)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _under(params: Mapping[str, torch.Tensor], prefix: str) -> dict:
    """The parameters named under ``prefix``, by their names within that submodule."""
    return {name[len(prefix):]: t for name, t in params.items() if name.startswith(prefix)}


def _output(out: torch.Tensor, record: recorders.Record, config: ModelConfig, packed, lead: tuple) -> MegatronOutput:
    not_provided = {}
    lse = record.get("lse")
    if lse is not None:  # kernel layout (rows, n) with +inf on rows without keys -> public [B, S, n] / [T, n], -inf
        lse = lse.masked_fill(torch.isposinf(lse), float("-inf"))
        if packed is None:
            lse = lse.reshape(lead[1], lead[0], -1).transpose(0, 1)
    else:
        not_provided["lse"] = "production's unfused attention (unfused_compressed_sparse_attn) computes no LSE"
    topk, scores = (None, None)
    if config.has_indexer:
        topk, scores, missing = _indexer_outputs(record, config, packed, lead)
        not_provided.update(missing)
    loss = record.get("loss")
    # float32 values of a float64 run (production's islands) in the case's dtype, exactly (the contract's dtype)
    lse, scores, loss = (None if t is None else t.to(_wide(out.dtype)) for t in (lse, scores, loss))
    return MegatronOutput(out=out, lse=lse, indexer_loss=loss, topk_indices=topk, index_scores=scores,
                          not_provided=not_provided)


def _check_covered(built, params: Mapping[str, torch.Tensor], prefix: str = "") -> None:
    """Every parameter of production's module is one of the harness's (the layer is built without initialising its
    weights: a parameter left out would compute with uninitialised memory)."""
    missing = [n for n in built.names if n.startswith(prefix) and n[len(prefix):] not in params]
    if missing:
        raise RuntimeError(f"production's layer has parameters the case does not provide: {', '.join(missing)}")


def attention_layer(hidden: torch.Tensor, params: Mapping[str, torch.Tensor], config: ModelConfig,
                    packed_seq_params: Optional[PackedSeqParams] = None, *, training: bool = True,
                    topk_indices: Optional[torch.Tensor] = None) -> AttentionOutput:
    """Production's whole layer on ``hidden`` BSHD ``[B, S, Hd]`` / THD ``[T, Hd]``."""
    _check_split(topk_indices)
    if cp.size() > 1:  # production's THD context-parallel branch over N rank processes (adapters.megatron.cp)
        out, call = cp.run("layer", {"hidden": hidden}, params, config, packed_seq_params, training, current())
        return cp.output(call, out, config, packed_seq_params)
    packed = packed_seq_params is not None
    lead = tuple(hidden.shape[:1] if packed else hidden.shape[:2])
    with run_context(current(), config, hidden, training) as (mg, built):
        x = _rows(hidden, packed)
        psp = _megatron_psp(mg, packed_seq_params, hidden.shape[0]) if packed else None
        _check_covered(built, params)
        with recorders.recording(mg) as record:
            out, _bias = functional_call(built.module, dict(params), (x, None),
                                         {"packed_seq_params": psp}, strict=False)
    out = out.squeeze(1) if packed else out.transpose(0, 1)
    return _output(out, record, config, packed_seq_params, lead)


def core_attention(query: torch.Tensor, kv: torch.Tensor, hidden: torch.Tensor, q_latent: torch.Tensor,
                   params: Mapping[str, torch.Tensor], config: ModelConfig,
                   packed_seq_params: Optional[PackedSeqParams] = None, *, training: bool = True,
                   topk_indices: Optional[torch.Tensor] = None) -> AttentionOutput:
    """Production's ``CompressedSparseAttention`` on roped ``query [.., n, D]``, ``kv [.., D]``, ``hidden`` and
    ``q_latent``; returns ``out [.., n, D]`` (before inverse RoPE)."""
    _check_split(topk_indices)
    if cp.size() > 1:
        inputs = {"query": query, "kv": kv, "hidden": hidden, "q_latent": q_latent}
        core = {name: t for name, t in params.items() if name.startswith(CORE_PREFIX)}
        out, call = cp.run("core", inputs, core, config, packed_seq_params, training, current())
        return cp.output(call, out, config, packed_seq_params)
    packed = packed_seq_params is not None
    lead = tuple(query.shape[:1] if packed else query.shape[:2])
    n, d = config.num_attention_heads, config.v_head_dim
    core_params = _under(params, CORE_PREFIX)
    with run_context(current(), config, query, training) as (mg, built):
        q, key = _core_query_key(query, kv, packed)
        x, qr = _rows(hidden, packed), _rows(q_latent, packed)
        psp = _megatron_psp(mg, packed_seq_params, query.shape[0]) if packed else None
        _check_covered(built, core_params, CORE_PREFIX)
        with recorders.recording(mg) as record:
            out = functional_call(built.module.core_attention, core_params, (q, key, key, None),
                                  {"x": x, "qr": qr, "packed_seq_params": psp}, strict=False)
    out = out.reshape(lead[0], n, d) if packed else out.reshape(lead[1], lead[0], n, d).transpose(0, 1)
    return _output(out, record, config, packed_seq_params, lead)


def _visible_compressed(rows: int, ratio: int, device) -> torch.Tensor:
    """The SBHD indexer's additive causal mask ``[S, S // r]`` float32: 0 where compressed entry ``j`` is visible to
    row ``t`` (``j < (t + 1) // r``, spec §3), ``-inf`` elsewhere."""
    t = torch.arange(rows, device=device).unsqueeze(1)
    j = torch.arange(rows // ratio, device=device).unsqueeze(0)
    return torch.zeros(rows, rows // ratio, dtype=torch.float32, device=device).masked_fill_(j >= (t + 1) // ratio,
                                                                                            float("-inf"))


def indexer(hidden: torch.Tensor, q_latent: torch.Tensor, params: Mapping[str, torch.Tensor], config: ModelConfig,
            packed_seq_params: Optional[PackedSeqParams] = None) -> tuple:
    """Production's lightning indexer on ``hidden`` and ``q_latent`` BSHD ``[B, S, ..]`` / THD ``[T, ..]`` ->
    ``(index_scores, topk_indices)`` in the contract's layout, read by the recorders from the production calls the
    core forward's eval path makes (``index_scores`` ``[B, S, n_comp]`` / ``[T, width]``, masked entries ``-inf``;
    ``None`` where production computes none). No gradient; CP 1 only.

    * ``unfused`` provider: the indexer module alone (``core_attention.indexer``), as the eval core forward calls it.
      BSHD gets the causal mask production's core forward hands the module (visible ``j < (t + 1) // r``); THD gets
      none (production's row bounds).
    * fused providers (``emulated``, ``cudnn``): there the kernels score, inside the core forward, so this is that
      forward (eval), stopped once its ``_indexer_topk_core`` has returned (:class:`recorders.ScoresRecorded`): the
      sparse attention and everything after it do not run. The core's query and KV are zeros: the fused path reads
      them only for the attention and its KV layout (never for the scores), which is what sign-split's bit-for-bit
      agreement check with the case's own forward confirms before it uses this."""
    if cp.size() > 1:
        raise CaseError("indexer", f"production's indexer alone runs at CP 1 only (CP {cp.size()})")
    if not config.has_indexer:
        raise CaseError("indexer", "the case's layer has no indexer")
    packed = packed_seq_params is not None
    lead = tuple(hidden.shape[:1] if packed else hidden.shape[:2])
    with torch.no_grad(), run_context(current(), config, hidden, False) as (mg, built):
        psp = _megatron_psp(mg, packed_seq_params, hidden.shape[0]) if packed else None
        x, qr = _rows(hidden, packed), _rows(q_latent, packed)
        if current() == "unfused":
            record = _indexer_module(mg, built, x, qr, params, psp, config)
        else:  # the core's query and KV, which the scores never read: zeros
            n, d = config.num_attention_heads, config.v_head_dim
            q, key = _core_query_key(hidden.new_zeros(lead + (n, d)), hidden.new_zeros(lead + (d,)), packed)
            record = _core_until_scored(mg, built, q, key, x, qr, params, psp)
    topk, scores, _ = _indexer_outputs(record, config, packed_seq_params, lead)
    return (None if scores is None else scores.to(_wide(hidden.dtype))), topk


def _indexer_module(mg, built, x: torch.Tensor, qr: torch.Tensor, params: Mapping[str, torch.Tensor], psp,
                    config: ModelConfig) -> recorders.Record:
    """The unfused provider's indexer module alone on production's ``x`` / ``qr`` (``[S, B, ..]`` / ``[T, 1, ..]``,
    ``psp`` None for BSHD); its record."""
    own = _under(params, INDEXER_PREFIX)
    _check_covered(built, own, INDEXER_PREFIX)
    mask = None
    if psp is None:
        rows, batch = x.shape[0], x.shape[1]
        mask = _visible_compressed(rows, config.compress_ratio, x.device).unsqueeze(0).expand(batch, -1, -1)
    with recorders.recording(mg) as record:
        functional_call(built.module.core_attention.indexer, own, (x, qr), {"mask": mask, "packed_seq_params": psp},
                        strict=False)
    return record


def _core_until_scored(mg, built, q: torch.Tensor, key: torch.Tensor, x: torch.Tensor, qr: torch.Tensor,
                       params: Mapping[str, torch.Tensor], psp) -> recorders.Record:
    """A fused provider's eval core forward on production's ``q`` / ``key`` / ``x`` / ``qr`` (its layout), stopped
    once its ``_indexer_topk_core`` has returned; its record (no ``fused_scores`` when production scored nothing: then
    the forward ran to its end)."""
    core_params = _under(params, CORE_PREFIX)
    _check_covered(built, core_params, CORE_PREFIX)
    with recorders.recording(mg, stop_after_scores=True) as record:
        try:
            functional_call(built.module.core_attention, core_params, (q, key, key, None),
                            {"x": x, "qr": qr, "packed_seq_params": psp}, strict=False)
        except recorders.ScoresRecorded:
            pass
    return record


class _QueryLatentSeen(Exception):
    """Raised by :func:`query_latent`'s hook once production handed its core attention ``qr``: the rest of the
    forward is not needed."""


def query_latent(hidden: torch.Tensor, params: Mapping[str, torch.Tensor], config: ModelConfig,
                 packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
    """Production's own query latent ``qr`` for ``hidden`` BSHD ``[B, S, Hd]`` / THD ``[T, Hd]`` -> ``[B, S, Rq]`` /
    ``[T, Rq]``: the ``qr`` its layer's eval forward hands ``core_attention`` (read by a forward pre-hook, which then
    stops the forward: nothing after the projections runs). Any provider; CP 1 only. No gradient."""
    if cp.size() > 1:
        raise CaseError("q_latent", f"production's query latent is read at CP 1 only (CP {cp.size()})")
    packed = packed_seq_params is not None
    seen = {}

    def capture(_module, _args, kwargs):
        qr = kwargs.get("qr")
        if not isinstance(qr, torch.Tensor):
            raise CaseError("q_latent", "production's layer called its core attention without a qr tensor keyword")
        seen["qr"] = qr.detach()
        raise _QueryLatentSeen

    with torch.no_grad(), run_context(current(), config, hidden, False) as (mg, built):
        x = _rows(hidden, packed)
        psp = _megatron_psp(mg, packed_seq_params, hidden.shape[0]) if packed else None
        _check_covered(built, params)
        handle = built.module.core_attention.register_forward_pre_hook(capture, with_kwargs=True)
        try:
            functional_call(built.module, dict(params), (x, None), {"packed_seq_params": psp}, strict=False)
        except _QueryLatentSeen:
            pass
        finally:
            handle.remove()
    if "qr" not in seen:
        raise CaseError("q_latent", "production's layer never called its core attention")
    qr = seen["qr"]
    return qr.reshape(hidden.shape[0], -1) if packed else qr.transpose(0, 1)
