"""Correct one wrong "Transformer Engine is installed" flag in megatron-core 0.16.1 when TE is absent.

``megatron.core.transformer.multi_latent_attention`` decides ``HAVE_TE`` by importing
``megatron.core.extensions.transformer_engine``, which itself *succeeds* without TE (it substitutes a
``MagicMock`` for the ``transformer_engine`` module). So MLA believes TE is present, and its constructor
runs ``isinstance(self.linear_proj, TELinear)`` with ``TELinear`` being a mock instance -> TypeError.
Every other Megatron module checks ``import transformer_engine`` directly and gets False.

``apply()`` sets that one flag to the truth. It is needed on GPU too whenever TE is not installed
(mtrain's local-spec path), so it is separate from the CPU shim. Idempotent.
"""
from __future__ import annotations

import importlib.util


def te_installed() -> bool:
    """True when the real transformer_engine package can be imported."""
    return importlib.util.find_spec("transformer_engine") is not None


def apply() -> None:
    """Make MLA's HAVE_TE match reality (no-op when Transformer Engine is installed)."""
    if te_installed():
        return
    import megatron.core.transformer.multi_latent_attention as mla

    mla.HAVE_TE = False
