"""dsv4-parity: the data model (model config, layout, case, tensors, outputs) shared by every other package.

``reference`` and ``fused`` both import this package and never each other.
"""

from .case import DTYPES, Case
from .config import ModelConfig
from .errors import CaseError
from .layout import BshdLayout, Layout, PackedSeqParams, ThdLayout, layout_from_dict
from .outputs import AttentionOutput
from .tensors import CaseTensors, layer_parameter_shapes, core_parameter_shapes, materialize, parameter_shapes

__all__ = ["AttentionOutput", "BshdLayout", "Case", "CaseError", "CaseTensors", "DTYPES", "Layout", "ModelConfig",
           "PackedSeqParams", "ThdLayout", "core_parameter_shapes", "layer_parameter_shapes", "layout_from_dict",
           "materialize", "parameter_shapes"]
