"""Two TE-absent gaps in megatron-core 0.16.1 that break the local (non-TE) spec, on CPU and GPU alike.

1. MLA thinks TE is installed.
``megatron.core.transformer.multi_latent_attention`` decides ``HAVE_TE`` by importing
``megatron.core.extensions.transformer_engine``, which itself *succeeds* without TE (it substitutes a
``MagicMock`` for the ``transformer_engine`` module). So MLA believes TE is present, and its constructor
runs ``isinstance(self.linear_proj, TELinear)`` with ``TELinear`` being a mock instance -> TypeError.
Every other Megatron module checks ``import transformer_engine`` directly and gets False.

2. Every MoE router fails with NameError. ``moe_utils`` imports ``te_general_gemm`` inside a
``try: import transformer_engine`` block whose ``except`` branch does not define it, and
``RouterGatingLinearFunction`` then tests ``te_general_gemm is not None`` -> NameError. The other names
of that import block are guarded by ``HAVE_TE`` first; this one is not. We define it as ``None``,
which is what the fallback branch evidently meant (the code then uses ``torch.mm``).

``apply()`` sets both. They are needed on GPU too whenever TE is not installed
(mtrain's local-spec path), so it is separate from the CPU shim. Idempotent. Both are values Megatron
reads, not code replaced.
"""
from __future__ import annotations

import importlib.util


def te_installed() -> bool:
    """True when the real transformer_engine package can be imported."""
    return importlib.util.find_spec("transformer_engine") is not None


def apply() -> None:
    """Set the two values above (no-op when Transformer Engine is installed)."""
    if te_installed():
        return
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla

    mla.HAVE_TE = False
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
