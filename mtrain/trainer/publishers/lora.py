"""Weight sync of a LoRA policy: the engine gets the frozen base once, then a new named adapter every step.

The first sync writes every base weight through the planner, as a full sync does (the engine starts from whatever
it was built with). Every sync, the first included, then gathers the adapter rows of the table
(mtrain/layouts/lora.py: A and B, a few MB) at HF names and full shapes on each engine group's leader, and the
leader hands them to its engine as the adapter `policy-v{version}`: SGLang's load_lora_adapter_from_tensors (its
LoRA registry and memory pool), the reference engine's PEFT layers, the same protocol
(mtrain/rollout/lora_adapters.py: load the new, route new requests to it, unload the old once unused). The engine
keeps its base weights between steps (the loop does not release them with LoRA: they never change). Both plans go
through the same planner and executor as a full sync (mtrain/trainer/publishers/colocated.py); the adapter plan in push mode into
the HF layout, since both engines take whole adapter tensors and slice them per rank themselves. With
engine.placement=separate both plans are point-to-point syncs (publishers/separate.py): the engine rank receives the
adapter rows and its AdapterTarget scatters them into whole tensors (`pull_weights`, the pull protocol's table run
on the engine rank's own host tensors), then loads them the same way. A vision-language model with
model.train_vision trains its vision tower in full beside the adapters: every later sync also writes the tower's rows
(a third plan, the base table's vision rows only) before the adapter switch.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from mtrain.layouts.lora import LoraSpec, lora_layout, peft_module_paths, peft_target_modules
from mtrain.layouts.table import ModelLayout
from mtrain.layouts.vlm import HF_VISION

# PEFT exclude_modules (a full-match regex on module paths): transformers' Qwen2.5-VL holds its tower at model.visual
VISION_MODULES = r".*\bvisual\..*"


def vision_layout(base: ModelLayout) -> ModelLayout:
    """The rows of a vision-language model's vision tower and patch merger (none for a text model)."""
    return replace(base, weights=[w for w in base.weights if any(p.name.startswith(HF_VISION) for p in w.hf)])


def engine_lora_args(base: ModelLayout, spec: LoraSpec) -> dict:
    """PEFT LoraConfig fields of the engine's adapter (the reference engine injects them; SGLang's
    lora_target_modules / max_lora_rank come from the same names). `module_targets`: the non-expert rows' modules as
    the reference engine's PEFT matches them, by their last two name components (a dense MLP's `mlp.gate_proj` is
    not DeepSeek's `shared_experts.gate_proj`); with expert rows also `experts`: the reference engine wraps
    transformers' fused expert parameters, not modules (mtrain/rollout/reference_engine_lora_experts.py)."""
    table = lora_layout(base, spec)
    out = {"r": spec.rank, "lora_alpha": spec.alpha, "target_modules": peft_target_modules(table)}
    if vision_layout(base).weights:  # Qwen2.5-VL's vision MLP has gate/up/down_proj too: adapters stay off it
        out["exclude_modules"] = VISION_MODULES
    dense = replace(table, weights=[w for w in table.weights if w.expert is None])
    out["module_targets"] = peft_module_paths(dense)
    if len(dense.weights) < len(table.weights):
        out["experts"] = True
    return out


class AdapterTarget:
    """What the adapter plan's executor writes into on a group leader: it collects one sync's adapter tensors
    (HF layout, one destination rank) and, when the sync finishes, loads them into the engine under the
    version's name (`switch_adapter`), then closes the engine's sync (weight_version, prefix cache flush)."""

    def __init__(self, engine, lora: dict, keep_in_use: bool = False):
        """keep_in_use: rollout.async=stream, whose syncs run with requests paused in place on the previous adapter
        (switch_adapter retires it instead of waiting for them)."""
        self.engine, self.lora, self.keep_in_use = engine, lora, keep_in_use
        self.tensors: dict = {}
        self._pulled: dict = {}  # separate placement: HF name -> whole tensor, written in place every sync
        self._pull = None

    def update_weights(self, rank_tensors) -> None:
        # the executor reuses its bucket buffers: keep copies (adapters are small)
        for name, t in rank_tensors[0]:
            self.tensors[name] = t.detach().clone()

    def pull_weights(self, jobs: list, version: int | None = None) -> None:
        """Separate placement (publishers/separate.py): one received bucket of the adapter plan (PullJob, HF
        layout, one destination rank) scattered into whole adapter tensors; `version` closes the sync. The
        tensors persist, so sync.delta's changed-pieces-only buckets leave the rest as they were."""
        import torch

        from mtrain.reshard.pull_protocol import PullSender, PullState, run_pull
        job = jobs[0]
        if job is not None:
            if self._pull is None:
                self._pull = (PullSender(1), PullState())
            sender, state = self._pull
            device = job.sources[0].device if job.sources else "cpu"  # where the received buckets live
            for name, shape in job.targets:  # float32 holds every sync dtype exactly; the engine casts on load
                if name not in self._pulled:
                    self._pulled[name] = torch.zeros(shape, dtype=torch.float32, device=device)
            run_pull(self._pulled, sender.payload(0, job, False, torch.empty(0)), state)
            sender.confirm(0, job)
        if version is not None:
            self.tensors = {k: v.clone() for k, v in self._pulled.items()}
            self.finish_weight_update(version)

    def finish_weight_update(self, version: int) -> None:
        from mtrain.rollout.lora_adapters import switch_adapter
        tensors, self.tensors = self.tensors, {}
        switch_adapter(self.engine, version, tensors, self.lora, keep_in_use=self.keep_in_use)
        self.engine.finish_weight_update(version)


class AdapterSync:
    def __init__(self, make_sync: Callable[..., object], base: ModelLayout, spec: LoraSpec, engine,
                 keep_in_use: bool = False, train_vision: bool = False):
        """make_sync(table, **overrides): a WeightSync over the rows of `table` (same groups and options; overrides
        replace engine / engine_kind / mode). engine: this rank's engine (a group leader) or None. keep_in_use:
        see AdapterTarget. train_vision: the vision tower and merger train in full beside the adapters, so every
        later sync also writes their rows (a full-weights sync of those rows only) before the adapter switch."""
        self.first = make_sync(base)
        target = AdapterTarget(engine, engine_lora_args(base, spec), keep_in_use) if engine is not None else None
        self.adapters = make_sync(lora_layout(base, spec), engine=target, engine_kind="hf", mode="push")
        self.vision = make_sync(vision_layout(base)) if train_vision else None
        self.synced = False

    def publish(self, version: int) -> dict[str, float]:
        """The WeightPublisher role (publishers/base.py)."""
        return self.sync(version=version)

    def sync(self, version: int) -> dict[str, float]:
        later = self.synced
        # the first sync writes the whole base (vision rows included); later ones the trained vision rows, then the
        # adapter, so a request that starts on the new adapter also encodes its images with the new tower
        full = (self.vision if later else self.first)
        out = self.adapters.sync(version) if full is None else _merge(full.sync(version), self.adapters.sync(version))
        self.synced = True
        out["sync/adapters_only"] = float(later and self.vision is None)
        if self.vision is not None:
            out["sync/adapters_and_vision"] = float(later)
        return out


def _merge(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in set(a) | set(b)}
