"""A case: one frozen, JSON-serialisable description of a parity run (config × layout × loss × dtype × seed).

Every tensor of the case (parameters, inputs, output gradient) is materialised deterministically from ``seed`` by
:mod:`cases.tensors`. ``case.id`` is a stable short hash of the canonical JSON; ``case.repro`` a one-line command.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shlex
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .config import ModelConfig
from .errors import CaseError, require
from .layout import BshdLayout, Layout, ThdLayout, layout_from_dict

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
SCOPES = ("layer", "core")
DEVICES = ("any", "cuda")
CASE_FIELDS = ("config", "layout", "dtype", "training", "scope", "seed", "device", "profile", "tags", "padding_dout")
#: What the output gradient holds on THD padding rows (alignment padding, dummy tail, slack): ``default`` = zero at
#: layer scope (a masked training loss), random at core scope; ``poison`` = huge random values at either scope.
PADDING_DOUT = ("default", "poison")


@dataclass(frozen=True)
class Case:
    """One parity case.

    * ``scope="layer"``: the whole ``DSv4HybridAttention`` layer, input ``hidden``; gradients of ``hidden`` and of
      every parameter.
    * ``scope="core"``: core attention only (spec §1.5), inputs ``query`` (roped, normalised), ``kv``, ``hidden``
      and ``q_latent``; gradients of those four and of the ``core_attention.*`` parameters.
    * ``training``: compute the indexer KL loss (only r=4 layers with an indexer have one); ``False`` is eval (Path C).
    * ``dtype``: activations / weights dtype. ``attn_sink`` and ``ape`` stay fp32 for bfloat16 (production).
    * ``device``: ``"cuda"`` if the case needs a GPU (kernel-profile shapes), else ``"any"``.
    * ``padding_dout``: the output gradient on THD padding rows (:data:`PADDING_DOUT`); ``poison`` needs padding
      rows. Serialised only when not ``default``, so the ids of earlier cases are unchanged.
    """

    config: ModelConfig
    layout: Layout
    dtype: str = "float64"
    training: bool = True
    scope: str = "layer"
    seed: int = 0
    device: str = "any"
    profile: str = "tiny"
    tags: tuple[str, ...] = ()
    padding_dout: str = "default"

    def __post_init__(self) -> None:
        self.validate()

    # ---- validation -----------------------------------------------------------------------------------------------
    def validate(self) -> "Case":
        require(isinstance(self.config, ModelConfig), "config", "must be a ModelConfig")
        self.config.validate("config")
        require(isinstance(self.layout, (BshdLayout, ThdLayout)), "layout", "must be a bshd or thd layout")
        self.layout.validate("layout")
        if isinstance(self.layout, ThdLayout):
            self.layout.validate_for_ratio(self.config.compress_ratio)
            require(self.layout.num_real_rows > 0, "layout.cu_seqlens",
                    "has no real token (every segment is padding): nothing to compare, and a mean loss over 0 rows")
        require(isinstance(self.dtype, str) and self.dtype in DTYPES, "dtype",
                f"must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        require(isinstance(self.training, bool), "training", f"must be true or false, got {self.training!r}")
        require(self.scope in SCOPES, "scope", f"must be one of {SCOPES}, got {self.scope!r}")
        require(isinstance(self.seed, int) and not isinstance(self.seed, bool) and 0 <= self.seed < 2 ** 63, "seed",
                f"must be a non-negative integer, got {self.seed!r}")
        require(self.device in DEVICES, "device", f"must be one of {DEVICES}, got {self.device!r}")
        require(isinstance(self.profile, str), "profile", "must be a string")
        require(isinstance(self.tags, tuple) and all(isinstance(t, str) for t in self.tags), "tags",
                "must be a list of strings")
        require(self.padding_dout in PADDING_DOUT, "padding_dout",
                f"must be one of {PADDING_DOUT}, got {self.padding_dout!r}")
        require(self.padding_dout == "default" or self.has_padding_rows, "padding_dout",
                f"{self.padding_dout!r} needs a THD layout with padding rows (this case has none)")
        return self

    # ---- derived --------------------------------------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def computes_loss(self) -> bool:
        return self.training and self.config.has_indexer

    @property
    def loss_mode(self) -> str:
        """``"none"``, ``"dense"`` or ``"sparse"``."""
        if not self.computes_loss:
            return "none"
        return "sparse" if self.config.dsa_indexer_use_sparse_loss else "dense"

    @property
    def loss_reduction(self) -> str:
        return "per_token" if self.config.calculate_per_token_loss else "mean"

    @property
    def is_thd(self) -> bool:
        return isinstance(self.layout, ThdLayout)

    @property
    def has_padding_rows(self) -> bool:
        """THD with rows that are not real tokens (alignment padding, dummy tail, slack)."""
        return self.is_thd and self.layout.num_real_rows < self.layout.total_tokens

    # ---- identity / serialisation -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = {"config": self.config.to_dict(), "layout": self.layout.to_dict(), "dtype": self.dtype,
                "training": self.training, "scope": self.scope, "seed": self.seed, "device": self.device,
                "profile": self.profile, "tags": list(self.tags)}
        if self.padding_dout != "default":
            data["padding_dout"] = self.padding_dout
        return data

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no whitespace (the id is a hash of it)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @functools.cached_property
    def id(self) -> str:
        """Stable 12-hex-digit id: sha256 of the canonical JSON without the cosmetic ``tags`` (computed once)."""
        data = self.to_dict()
        data.pop("tags")
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def repro(self) -> str:
        """A one-line command that re-runs exactly this case."""
        return f"dsv4-parity run --case {shlex.quote(self.to_json())}"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Case":
        if not isinstance(data, Mapping):
            raise CaseError("case", f"must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(CASE_FIELDS))
        if unknown:
            raise CaseError(unknown[0], f"unknown field (known: {', '.join(CASE_FIELDS)})")
        for name in ("config", "layout"):
            if name not in data:
                raise CaseError(name, "missing required field")
        tags = data.get("tags", [])
        if not isinstance(tags, (list, tuple)):
            raise CaseError("tags", "must be a list of strings")
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        return cls(config=ModelConfig.from_dict(data["config"]), layout=layout_from_dict(data["layout"]),
                   dtype=data.get("dtype", defaults["dtype"]), training=data.get("training", defaults["training"]),
                   scope=data.get("scope", defaults["scope"]), seed=data.get("seed", defaults["seed"]),
                   device=data.get("device", defaults["device"]), profile=data.get("profile", defaults["profile"]),
                   tags=tuple(tags), padding_dout=data.get("padding_dout", defaults["padding_dout"]))

    @classmethod
    def from_json(cls, text: str) -> "Case":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CaseError("case", f"is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> "Case":
        return dataclasses.replace(self, **changes)
