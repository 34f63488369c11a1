"""Whether Transformer Engine is installed (then its fused-layernorm specs are used; mtrain never requires it).

megatron-core 0.16.1 had two TE-absent gaps that broke the local spec (MLA believed TE present; the MoE router's
``te_general_gemm`` was undefined), which this module used to fill; 0.19 has neither (its MLA reads
``extensions.transformer_engine.HAVE_TE``, which is False without TE, and ``moe_utils`` sets ``te_general_gemm`` to
None), so only the check remains.
"""
from __future__ import annotations

import importlib.util


def te_installed() -> bool:
    """True when the real transformer_engine package can be imported."""
    return importlib.util.find_spec("transformer_engine") is not None
