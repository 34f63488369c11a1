"""The weight-layout tables: every logical weight with its Megatron, HF and SGLang names and shardings.

Everything that touches weights reads these tables (converters, the resharding planner, engines, tests).
"""
from mtrain.layouts.models import ARCHS, model_layout, moe_layer_pattern
from mtrain.layouts.rules import LayoutError, Rect
from mtrain.layouts.table import ModelLayout, Part, Weight

__all__ = ["ARCHS", "model_layout", "moe_layer_pattern", "LayoutError", "Rect", "ModelLayout", "Part", "Weight"]
