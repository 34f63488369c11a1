"""LoRA adapters of the CPU reference engine, held unmerged in PEFT adapter slots (a mixin of ReferenceEngine,
reference_engine.py, which owns the state it uses)."""
from __future__ import annotations

import warnings

import torch
from transformers.core_model_loading import revert_weight_conversion

from mtrain.rollout.protocol import EngineError
from mtrain.rollout.reference_engine_lora_experts import as_given, fuse_expert_tensors, peft_lora_config, wrapper_params


class ReferenceLoraSlots:
    """load_lora_adapter / unload_lora_adapter / adapter_state and the PEFT slots behind them."""

    # ---------------------------------------------------------------- LoRA adapters
    # Adapters live in PEFT adapter slots ("slot0", "slot1", ...: injected once each, reused), as SGLang's live in its
    # LoRA memory pool: a load writes a free slot in place (a copy of A/B, no module construction), an unload frees it.
    def load_lora_adapter(self, name: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
        """Add adapter `name`: tensors by the adapter table's HF names (q_proj.lora_A.weight, full shapes), config
        PEFT's adapter_config (r, lora_alpha, target_modules as this engine was built with). Nothing is written
        unless every adapter weight is given once with the right shape."""
        self._check_alive("load_lora_adapter")
        if self._lora is None:
            raise EngineError("load_lora_adapter: this engine was built without LoRA (lora=None)")
        want = {k: config.get(k) for k in ("r", "lora_alpha", "target_modules")}
        have = {"r": self._lora["r"], "lora_alpha": float(self._lora["lora_alpha"]),
                "target_modules": list(self._lora["target_modules"])}
        if {**want, "lora_alpha": float(want["lora_alpha"] or 0)} != have:
            raise EngineError(f"load_lora_adapter({name!r}): config {want} differs from the engine's {have}")
        tensors = fuse_expert_tensors(tensors)  # per-expert names -> PEFT's fused-expert wrappers (no-op if none)
        with self._model_lock:
            if name in self._slot_of:
                raise EngineError(f"load_lora_adapter: adapter {name!r} is already loaded")
            slot = self._free_slot()
            params = self._slot_params(slot)
            extra, missing = sorted(set(tensors) - set(params)), sorted(set(params) - set(tensors))
            if extra or missing:
                raise EngineError(f"load_lora_adapter({name!r}): unknown {extra[:3]}, missing {missing[:3]} "
                                  f"(of {len(params)} adapter weights)")
            for k, t in tensors.items():
                if tuple(t.shape) != tuple(params[k].shape):
                    raise EngineError(f"load_lora_adapter({name!r}): {k!r} has shape {tuple(t.shape)}, "
                                      f"the adapter holds {tuple(params[k].shape)}")
            with torch.no_grad():
                for k, t in tensors.items():
                    params[k].copy_(t)
            self._slot_of[name] = slot

    def unload_lora_adapter(self, name: str) -> None:
        self._check_alive("unload_lora_adapter")
        with self._model_lock:
            if name == self.adapters.active:
                raise EngineError(f"unload_lora_adapter: {name!r} is the active adapter")
            if name not in self._slot_of:
                raise EngineError(f"unload_lora_adapter: no adapter {name!r} (loaded: {self._adapter_names()})")
            del self._slot_of[name]

    def adapter_state(self, name: str | None = None) -> dict[str, torch.Tensor]:
        """HF name -> tensor of adapter `name` (default: the active one), as the engine holds it."""
        name = name or self.adapters.active
        return {k: v.detach() for k, v in self._slot_params(self._slot_of[name]).items()} if name else {}

    def _token_version(self) -> int:
        """The version a token decoded now carries: with LoRA its request's adapter (the base never changes after the
        first sync; a request keeps its adapter through an update in place), else the engine's weights."""
        from mtrain.rollout.lora_adapters import version_of
        held = getattr(self._call, "adapter", None)
        v = version_of(held[0]) if self._lora is not None and held is not None else None
        return self._version if v is None else v

    def _adapter_names(self) -> list[str]:
        return sorted(self._slot_of)

    def _free_slot(self) -> str:
        """A PEFT adapter slot no loaded adapter holds; a new one is injected when all are taken."""
        import peft
        free = [s for s in self._slot_cache if s not in self._slot_of.values()]
        if free:
            return free[0]
        slot = f"slot{len(self._slot_cache)}"
        with warnings.catch_warnings():  # "multiple adapters in the model": one slot per live version, on purpose
            warnings.simplefilter("ignore", UserWarning)
            # PEFT checks rank/alpha_pattern against target_modules only; the gate_up_proj key does apply, to the
            # fused-expert target_parameters (reference_engine_lora_experts.py)
            warnings.filterwarnings("ignore", "The following (rank|alpha)_pattern keys did not match", RuntimeWarning)
            with as_given():  # the config names transformers 5's modules and parameters already
                peft.inject_adapter_in_model(peft_lora_config(self._lora), self._model, adapter_name=slot)
        self._model.to(self._dtype).requires_grad_(False)
        self._slot_params(slot)  # every injected slot is in _slot_cache from here on
        return slot

    def _slot_params(self, slot: str) -> dict[str, torch.nn.Parameter]:
        """The HF name (the adapter table's) -> PEFT parameter of adapter slot `slot` (built once per slot)."""
        if slot in self._slot_cache:
            return self._slot_cache[slot]
        out = wrapper_params(self._model, slot)  # fused experts, by their own names
        wrapped, plain = {id(p) for p in out.values()}, {}
        for pname, p in self._model.named_parameters():
            if id(p) in wrapped:
                continue
            for ab in ("lora_A", "lora_B"):
                tag = f".{ab}.{slot}."
                if tag in pname:
                    plain[pname.replace(".base_layer.", ".").replace(tag, f".{ab}.")] = p
        # in-memory module paths -> the checkpoint's (Qwen2.5-VL: model.language_model.layers.* -> model.layers.*),
        # transformers' own save-time renaming, as for the base weights (hf_disk_views); identity for text models
        out.update(revert_weight_conversion(self._model, plain))
        self._slot_cache[slot] = out
        return out

    def _use_adapter(self, name: str | None) -> None:
        """PEFT layers compute with adapter `name` (None: the base alone). Called under the model lock."""
        from peft.tuners.lora import LoraLayer
        for m in self._model.modules():
            if isinstance(m, LoraLayer):
                if name is None:
                    m.enable_adapters(False)
                else:
                    m.enable_adapters(True)
                    m.set_adapter(self._slot_of[name])
        self._model.requires_grad_(False)  # set_adapter marks the adapter trainable
