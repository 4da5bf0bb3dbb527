"""Access to the parameter dict (production ``named_parameters()`` names, spec §1.2) with clear errors."""

from __future__ import annotations

from typing import Mapping

import torch

from cases.errors import CaseError


def get_param(params: Mapping[str, torch.Tensor], name: str, shape: tuple | None = None) -> torch.Tensor:
    """``params[name]``, checked to exist (and to have ``shape`` when given); raises ``CaseError('params.<name>')``."""
    if name not in params:
        raise CaseError(f"params.{name}", "missing parameter")
    value = params[name]
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise CaseError(f"params.{name}", f"has shape {tuple(value.shape)}, expected {tuple(shape)}")
    return value
