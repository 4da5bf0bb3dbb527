"""The kernel-call interface of the fused DSv4 path: one method per production kernel call.

Every method has the argument names, tensor shapes, dtypes, layouts and return conventions of the wrapper that
Megatron-LM ``dev`` calls on Hopper (cudnn-frontend 1.32.0 ``cudnn.DSA.*`` wrappers, FlashMLA ``nv_dev``
``flash_mla_sparse_fwd``, the Triton teacher LSE). A provider (``torch`` here; ``cudnn`` / ``flashmla`` later)
subclasses :class:`KernelSet` and implements the methods it has kernels for.

Two kinds of checks, kept apart on purpose:

* **argument contract** — ranks, index dtypes (int32), required arguments (``max_seqlen_*`` for THD), shape
  consistency between arguments, contiguity where the wrapper does not stage copies. Enforced once, by the
  dispatcher (``fused.plan.kernels``) before it chooses a provider (``fused.kernels.contracts.check``), with the
  exception type and message the real wrapper raises, so a composition bug fails on the CPU exactly as it would on
  the GPU, whichever provider would have run the call.
* **kernel shape support** — what a given kernel build accepts (bf16 only, head dim 512, indexer heads ≥ 64,
  ``K % 128 == 0`` …). Per provider, one lifecycle (cudnn-frontend's ``check_support`` → ``execute``):
  :meth:`KernelSet.check_support` answers a reason string (``None`` = supported) so a backend plan can tell
  "unsupported" apart from "wrong", then :meth:`KernelSet.execute` runs the call.

Symbols: ``B`` batch, ``S_q``/``S_k`` query/key rows, ``T`` packed rows, ``H`` query heads, ``D`` head dim,
``K`` index width. "Global" index = flat row of the packed / flattened key buffer; "local" = row within a batch
element or segment.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

import torch

Tensor = torch.Tensor

#: Every kernel stage of the fused path, named after the production wrapper it stands for.
STAGES = (
    "indexer_forward",                 # cudnn.DSA.indexer_forward_wrapper
    "indexer_top_k",                   # cudnn.DSA.indexer_top_k_wrapper
    "compactify",                      # cudnn.DSA.compactify_wrapper
    "sparse_attn_fwd",                 # flash_mla.flash_mla_sparse_fwd
    "sparse_attn_bwd",                 # cudnn.DSA.sparse_attention_backward_wrapper
    "sparse_attn_score_recompute",     # cudnn.DSA.sparse_attn_score_recompute_wrapper   (target)
    "sparse_indexer_score_recompute",  # cudnn.DSA.sparse_indexer_score_recompute_wrapper (predict)
    "dense_attn_score_recompute",      # cudnn.DSA.dense_attn_score_recompute_wrapper
    "dense_indexer_score_recompute",   # cudnn.DSA.dense_indexer_score_recompute_wrapper
    "indexer_backward",                # cudnn.DSA.indexer_backward_wrapper
    "dense_indexer_backward",          # cudnn.DSA.dense_indexer_backward_wrapper
    "csa_teacher_lse",                 # csa_teacher_lse.fused_csa_teacher_lse (Triton)
)


class TupleDict(dict):
    """The wrappers' return type: a dict that also unpacks (and integer-indexes) like a tuple, in insertion order."""

    def __iter__(self):
        return iter(list(self.values()))

    def __getitem__(self, key):
        if isinstance(key, int):
            return list(self.values())[key]
        return super().__getitem__(key)


@functools.lru_cache(maxsize=None)
def _stage_signature(stage: str) -> inspect.Signature:
    signature = inspect.signature(getattr(KernelSet, stage))
    return signature.replace(parameters=list(signature.parameters.values())[1:])  # without ``self``


def bind_arguments(stage: str, args: tuple = (), kwargs: Optional[dict] = None) -> dict[str, Any]:
    """The arguments of a ``stage`` call by name, defaults applied, exactly as the stage method receives them (a
    ``TypeError`` names a missing or unknown argument, as calling the method would)."""
    bound = _stage_signature(stage).bind(*args, **(kwargs or {}))
    bound.apply_defaults()
    return dict(bound.arguments)


class KernelSet:
    """Base class of a kernel provider. Methods not implemented by a provider raise ``NotImplementedError``.

    Class attributes a provider sets:

    * ``name`` — registry key (``"torch"``, ``"cudnn"``, ``"flashmla"``);
    * ``stages`` — the subset of :data:`STAGES` it implements;
    * ``topk_alignment`` — the index width ``sparse_attn_fwd`` callers pad to (Megatron's ``_get_topk_alignment``:
      128 on sm90, 64 on sm100);
    * ``topk_tie_rule`` — what ``indexer_top_k`` selects among equal scores: ``"lower-index"`` (deterministically
      the lower column) or ``"arbitrary"`` (any of them: the production radix top-k). The parity engine enforces a
      declared ``lower-index`` on exactly tied rows (``fused.plan.topk_tie_rule``).
    """

    name: str = "abstract"
    stages: frozenset = frozenset()
    topk_alignment: int = 128
    topk_tie_rule: str = "arbitrary"

    # ---- availability / support ------------------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        """``None`` if this provider can run here (imports, device), else why not."""
        return None

    def check_support(self, stage: str, *args: Any, **kwargs: Any) -> Optional[str]:
        """Reason this provider cannot run ``stage`` on these arguments (kernel shape support), or ``None``.

        Called with exactly the arguments of the stage's method (positionally or by name). Not overridden: a
        provider declines calls in ``support_<stage>(arguments)`` methods, which get the arguments by name
        (:func:`bind_arguments`); a stage without one is supported whenever it is implemented. The argument
        contract is not this method's business (the dispatcher checked it already).
        """
        if stage not in self.stages:
            return f"{self.name} has no {stage} kernel"
        hook = getattr(self, f"support_{stage}", None)
        return hook(bind_arguments(stage, args, kwargs)) if hook is not None else None

    def execute(self, stage: str, arguments: dict[str, Any]) -> Any:
        """Run ``stage`` on its arguments by name (after :meth:`check_support` accepted them)."""
        return getattr(self, stage)(**arguments)

    # ---- indexer --------------------------------------------------------------------------------------------
    def indexer_forward(self, q: Tensor, k: Tensor, w: Tensor, ratio: int = 4, qhead_per_kv_head: Optional[int] = None,
                        sm_scale: float = 1.0, *, cu_seqlens_q: Optional[Tensor] = None,
                        cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                        max_seqlen_k: Optional[int] = None, q_causal_offsets: Optional[Tensor] = None) -> TupleDict:
        """Dense indexer scores ``sm_scale * sum_h w[h] * relu(q[h] . k)`` under the ratio-causal mask.

        BSHD: ``q (B,S_q,H,D)``, ``k (B,S_k,1,D)``, ``w (B,S_q,H)`` → ``{"scores": (B,S_q,S_k)}``.
        THD: ``q (T,H,D)``, ``k (T_k,1,D)``, ``w (T,H)``, int32 ``cu_seqlens_q/k (N+1,)`` and host ints
        ``max_seqlen_q/k`` (required) → ``{"scores": (T, max_seqlen_k)}`` by *local* key column.
        Column ``s`` of query row ``i`` (local) is valid iff ``s < min(len_k, (offset + i + 1) // ratio)``; invalid
        columns and rows outside every segment are ``-inf``. Scores fp32 (float64 in float64 mode).
        """
        raise NotImplementedError

    def indexer_top_k(self, input_values: Tensor, seq_lens: Tensor, top_k: int, next_n: int = 1,
                      return_val: bool = True, num_copy_bits: int = 256, stream: Any = None, tie_break: int = 0,
                      deterministic: bool = False) -> TupleDict:
        """Row-wise top-``top_k`` of ``input_values (n_rows, num_cols)`` over the first ``seq_lens[r]`` columns.

        ``seq_lens`` int32 ``(n_rows // next_n,)``. → ``{"indices": int32 (n_rows, top_k), "values": ... or None}``:
        local column ids, short rows padded with ``-1`` (values ``-inf``); slot order unspecified.
        """
        raise NotImplementedError

    def compactify(self, indices: Tensor, stream: Any = None) -> TupleDict:
        """Pack the valid (``>= 0``) entries of each row of int32 ``indices (M,K)`` (or ``(B,S,K)``, flattened
        batch-major) to a prefix, in their original order, ``-1`` after.
        → ``{"indices", "topk_length" (M,) int32}``."""
        raise NotImplementedError

    # ---- sparse attention -----------------------------------------------------------------------------------
    def sparse_attn_fwd(self, q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float, d_v: int = 512,
                        attn_sink: Optional[Tensor] = None, topk_length: Optional[Tensor] = None,
                        indexer_topk: int = 0) -> tuple:
        """FlashMLA ``flash_mla_sparse_fwd``: ``q (s_q,h_q,d_qk)``, ``kv (s_kv,1,d_qk)``, int32 global
        ``indices (s_q,1,topk)`` (``-1`` or ``>= s_kv`` = invalid), optional fp32 ``attn_sink (h_q,)`` and int32
        ``topk_length (s_q,)`` (only the first ``topk_length[i]`` slots are read).

        → ``(out (s_q,h_q,d_v) in q's dtype, max_logits (s_q,h_q), lse (s_q,h_q))``; ``lse`` is the natural-log
        sum-exp over the valid keys **without** the sink, ``+inf`` for a row with no valid key (``out`` 0 there);
        the sink only rescales ``out`` by ``exp(lse) / (exp(lse) + exp(sink))``.
        """
        raise NotImplementedError

    def sparse_attn_bwd(self, q: Tensor, kv: Tensor, out: Tensor, dout: Tensor, lse: Tensor, attn_sink: Tensor,
                        topk_idxs: Tensor, softmax_scale: Optional[float] = None,
                        topk_length: Optional[Tensor] = None, dq: Optional[Tensor] = None,
                        dkv: Optional[Tensor] = None, block_tile: int = 64, deterministic: bool = False,
                        stream: Any = None, workspace: Optional[Tensor] = None,
                        q_cluster_mode: str = "off") -> TupleDict:
        """cuDNN ``sparse_attention_backward_wrapper`` on flat tensors: ``q (T_q,H,D)``, **2-D** ``kv (T_kv,D)``,
        ``out/dout (T_q,H,D)``, KV-only ``lse (T_q,H)``, ``attn_sink (H,)`` (required; ``-inf`` = none), **2-D**
        int32 global ``topk_idxs (T_q,K)``, optional ``topk_length``. → ``{"dq", "dkv", "d_sink"}``."""
        raise NotImplementedError

    # ---- loss score recompute ------------------------------------------------------------------------------
    def sparse_attn_score_recompute(self, q_attn: Tensor, k_attn: Tensor, lse: Tensor, topk_indices: Tensor,
                                    softmax_scale: float, qhead_per_kv_head: Optional[int] = None,
                                    topk_length: Optional[Tensor] = None, topk_indices_global: bool = False,
                                    out: Optional[Tensor] = None, stream: Any = None) -> TupleDict:
        """Sparse loss target: ``q (B,S_q,H,D)``, ``k (B,S_k,D)``, ``lse (B,S_q,H)``, ``topk (B,S_q,K)`` (local,
        or ``b*S_k + local`` with ``topk_indices_global``). → ``{"target": (B,S_q,K)}`` =
        ``sum_h exp(scale q_h.k - lse_h)`` L1-normalised over the valid slots, 0 on invalid slots. THD callers pass
        a fake batch of 1 with global ids."""
        raise NotImplementedError

    def sparse_indexer_score_recompute(self, q_indexer: Tensor, k_indexer: Tensor, weights: Tensor,
                                       topk_indices: Tensor, qhead_per_kv_head: Optional[int] = None,
                                       topk_length: Optional[Tensor] = None, topk_indices_global: bool = False,
                                       out: Optional[Tensor] = None, stream: Any = None) -> TupleDict:
        """Sparse loss predict: ``{"predict": (B,S_q,K)}`` = softmax over the valid slots of
        ``sum_h relu(q_h.k) * w_h`` (no ``sm_scale``: fold it into ``weights``), 0 on invalid slots."""
        raise NotImplementedError

    def dense_attn_score_recompute(self, q: Tensor, k: Tensor, lse: Tensor, softmax_scale: float,
                                   qhead_per_kv_head: Optional[int] = None, out: Optional[Tensor] = None,
                                   denom_out: Optional[Tensor] = None, ratio: int = 1, *,
                                   cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                                   max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                                   q_causal_offsets: Optional[Tensor] = None) -> TupleDict:
        """Dense loss target: BSHD ``q (B,S_q,H,D)``, ``k (B,S_k,1,D)``, ``lse (B,S_q,H)``; THD ``(T,H,D)``,
        ``(T_k,1,D)``, ``(T,H)`` + cu_seqlens/max_seqlen. → ``{"out": sum_h exp(scale q_h.k - lse_h)`` over the
        ratio-causal columns (masked entries not to be relied on), ``"denom"``: its L1 sum``}``."""
        raise NotImplementedError

    def dense_indexer_score_recompute(self, q: Tensor, k: Tensor, weights: Tensor,
                                      qhead_per_kv_head: Optional[int] = None, out: Optional[Tensor] = None,
                                      denom_out: Optional[Tensor] = None, sm_scale: float = 1.0, ratio: int = 1, *,
                                      cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                                      max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                                      q_causal_offsets: Optional[Tensor] = None) -> TupleDict:
        """Dense loss predict scores: ``{"out": sm_scale * sum_h relu(q_h.k) w_h`` (``-inf`` masked),
        ``"denom"``: row logsumexp``}``; layouts as :meth:`dense_attn_score_recompute`."""
        raise NotImplementedError

    # ---- indexer backward (loss gradients, computed eagerly in the forward with grad_loss = 1) ----------------
    def indexer_backward(self, index_q: Tensor, weights: Tensor, index_k: Tensor, attn_score: Tensor,
                         index_score: Tensor, topk_indices: Tensor, grad_loss: Tensor, sm_scale: float = 1.0,
                         loss_coeff: float = 1.0, block_I: int = 128, topk_indices_global: bool = False,
                         d_index_q: Optional[Tensor] = None, d_weights: Optional[Tensor] = None,
                         d_index_k: Optional[Tensor] = None, stream: Any = None) -> TupleDict:
        """Sparse KL backward: ``index_q (B,S_q,H,D)``, ``weights (B,S_q,H)`` (unscaled), ``index_k (B,S_k,D)``,
        ``attn_score`` = target and ``index_score`` = predict ``(B,S_q,K)`` fp32, int32 ``topk_indices (B,S_q,K)``,
        ``grad_loss`` a one-element fp32 tensor. Gradient of
        ``loss_coeff / (B*S_q) * grad_loss * KL(target || predict)`` w.r.t. the indexer logits
        ``sm_scale * sum_h w_h relu(q_h.k)``, pushed into q, w, k. **Overwrites ``attn_score`` in place** with the
        score gradient. → ``{"d_index_q", "d_weights", "d_index_k"}``."""
        raise NotImplementedError

    def dense_indexer_backward(self, index_q: Tensor, weights: Tensor, index_k: Tensor, attn_score: Tensor,
                               attn_l1norm: Tensor, index_score: Tensor, index_lse: Tensor, grad_loss: Tensor,
                               sm_scale: float = 1.0, loss_coeff: float = 1.0, block_I: int = 128, ratio: int = 1,
                               cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                               max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                               q_causal_offsets: Optional[Tensor] = None, d_index_q: Optional[Tensor] = None,
                               d_weights: Optional[Tensor] = None, d_index_k: Optional[Tensor] = None,
                               stream: Any = None, workspace: Optional[Tensor] = None) -> TupleDict:
        """Dense KL backward over every ratio-causal column: BSHD ``q (B,S_q,H,D)``, ``w (B,S_q,H)``,
        ``k (B,S_k,D)``, raw scores ``(B,S_q,S_k)`` and denominators ``(B,S_q)``; THD ``(T,H,D)``, ``(T,H)``,
        **2-D** ``k (T_k,D)``, ``(T,max_seqlen_k)``, ``(T,)`` + cu_seqlens + max_seqlen. Normalised by the
        physical row count (``B*S_q`` or ``T``). **Overwrites ``index_score`` in place** with the score gradient."""
        raise NotImplementedError

    # ---- teacher LSE for the dense loss ------------------------------------------------------------------------
    def csa_teacher_lse(self, query: Tensor, full_kv: Tensor, compressed_kv: Tensor, attn_sink: Tensor,
                        window_indices: Tensor, softmax_scale: float, ratio: int, *,
                        batch_size: Optional[int] = None, seqlen_q: Optional[int] = None,
                        cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                        max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                        q_causal_offsets: Optional[Tensor] = None) -> Tensor:
        """The full dense CSA teacher LSE ``logaddexp(sink, window, all ratio-causal compressed keys)``.

        ``query (T,H,D)`` and ``full_kv (T_kv,D)`` in FlashMLA's flat layout, ``window_indices (T,W)`` global ids
        into ``full_kv``. SBHD: flat row ``s*B + b``, ``compressed_kv (B,S_k,D)``, ``batch_size``/``seqlen_q``
        required, result ``(B,S_q,H)``. THD: ``compressed_kv (T_k,D)`` + ``cu_seqlens_q/k`` and ``max_seqlen_q/k``,
        result ``(T,H)`` (rows outside every segment are not written)."""
        raise NotImplementedError
