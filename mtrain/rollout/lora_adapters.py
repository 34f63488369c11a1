"""Engine-side LoRA: versioned adapter names, which one new requests use, and when an old one may go.

With model.lora an engine keeps its frozen base weights and holds the policy's adapter under a name per weight
version, ``policy-v{version}`` (both engines: SGLang's LoRA registry and memory pool, the reference engine's PEFT
layers). A sync loads the new version, makes it the one new requests name, then unloads the previous version once
no in-flight request names it: a request is stamped with the active name when it enters the engine (`acquire`)
and holds it until it finishes (`release`), so no request ever references an unloaded adapter. SGLang also drains
its own per-adapter counter before an unload (tokenizer_control_mixin._unload_lora_adapter_locked); ours covers the
moment between stamping a request and SGLang registering it.

Under rollout.async=stream a sync runs while requests are paused in place, holding the previous adapter: they cannot
finish before the sync does, so waiting for them would never end. There the switch retires the previous version
instead (`keep_in_use=True`): the paused requests continue on the adapter they started on, their tokens carry that
adapter's version (`version_of`; the base never changes, so the adapter is the whole policy), and a retired adapter
is unloaded at a later switch once no request names it. docs/design-lora.md says why (SGLang binds a request to its
adapter for its whole life).
"""
from __future__ import annotations

import threading
from collections import Counter

PREFIX = "policy-v"


def adapter_name(version: int) -> str:
    return f"{PREFIX}{int(version)}"


def version_of(name: str | None) -> int | None:
    """The weight version of adapter `name` (policy-v{n} -> n); None for the base model (no adapter yet)."""
    return None if name is None else int(name[len(PREFIX):])


def peft_config(lora: dict) -> dict:
    """PEFT's adapter_config fields for an engine's adapter: lora = {r, lora_alpha, target_modules}
    (mtrain.trainer.publishers.lora.engine_lora_args). SGLang's load_lora_adapter_from_tensors takes this dict."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", "lora_dropout": 0.0,
            "r": int(lora["r"]), "lora_alpha": float(lora["lora_alpha"]),
            "target_modules": list(lora["target_modules"])}


class AdapterVersions:
    """The active adapter name and how many in-flight requests name each adapter (thread-safe)."""

    def __init__(self) -> None:
        self.active: str | None = None
        self.retired: list[str] = []  # replaced while requests still named them (keep_in_use): unloaded later
        self._uses: Counter = Counter()
        self._cond = threading.Condition()

    def acquire(self) -> str | None:
        """The name a request entering the engine now uses (None: the base model, before the first adapter)."""
        with self._cond:
            if self.active is not None:
                self._uses[self.active] += 1
            return self.active

    def release(self, name: str | None) -> None:
        if name is None:
            return
        with self._cond:
            self._uses[name] -= 1
            if self._uses[name] <= 0:
                del self._uses[name]
                self._cond.notify_all()

    def in_use(self, name: str) -> int:
        with self._cond:
            return self._uses.get(name, 0)

    def activate(self, name: str) -> str | None:
        """Make `name` the adapter new requests use; returns the previous one."""
        with self._cond:
            old, self.active = self.active, name
            return old

    def wait_unused(self, name: str, timeout_s: float) -> bool:
        """Block until no in-flight request names `name` (True), or `timeout_s` passes (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._uses.get(name, 0) == 0, timeout=timeout_s)


def switch_adapter(engine, version: int, tensors: dict, lora: dict, *, drain_timeout_s: float = 600.0,
                   keep_in_use: bool = False) -> str:
    """Load `tensors` (adapter-table HF names -> full tensors) as adapter_name(version), route new requests to
    it, then unload the previous version once its requests are done. Returns the new name. engine: a RolloutEngine
    with `adapters` (AdapterVersions), load_lora_adapter(name, tensors, config), unload_lora_adapter(name).
    keep_in_use (stream: requests paused in place hold the previous version): never wait; a previous version still
    named by a request is retired and unloaded by a later switch once none does."""
    from mtrain.rollout.protocol import EngineError

    new = adapter_name(version)
    old = engine.adapters.active
    if new == old:  # a repeated sync of the same version (a resume): replace it under a fresh name
        raise EngineError(f"switch_adapter: adapter {new!r} is already active; versions must increase")
    engine.load_lora_adapter(new, tensors, peft_config(lora))
    engine.adapters.activate(new)
    if keep_in_use:
        retired = engine.adapters.retired + ([old] if old is not None else [])
        # a retired name is never handed out again, so its count can only fall: 0 now means 0 for good
        engine.adapters.retired = [n for n in retired if engine.adapters.in_use(n) > 0]
        for name in retired:
            if name not in engine.adapters.retired:
                engine.unload_lora_adapter(name)
        return new
    if old is not None:
        if not engine.adapters.wait_unused(old, drain_timeout_s):
            raise EngineError(f"switch_adapter: {engine.adapters.in_use(old)} requests still name adapter {old!r} "
                              f"after {drain_timeout_s:.0f} s; it stays loaded")
        engine.unload_lora_adapter(old)
    return new
