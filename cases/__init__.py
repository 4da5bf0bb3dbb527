"""dsv4-parity: the data model (model config, layout, case, tensors, outputs) shared by every other package.

``reference`` and ``fused`` both import this package and never each other.

The names below are loaded on first use (PEP 562), so that ``cases.errors`` and ``cases.vocabulary`` — what the
command line parses and validates with — import without torch; ``from cases import Case`` works as before.
"""

from __future__ import annotations

import importlib

#: public name -> submodule defining it
_EXPORTS = {
    "AttentionOutput": "outputs", "BshdLayout": "layout", "Case": "case", "CaseError": "errors",
    "CaseTensors": "tensors", "DTYPES": "case", "Layout": "layout", "ModelConfig": "config",
    "PackedSeqParams": "layout", "ThdLayout": "layout", "core_parameter_shapes": "tensors",
    "layer_parameter_shapes": "tensors", "layout_from_dict": "layout", "materialize": "tensors",
    "parameter_shapes": "tensors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cases' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
