"""A reward for tests/trainer/test_loop_lora_vlm.py: count_shapes' reward (+1 for each group's first sample, so no
group is uniform and every step has a gradient), and, once per engine weight version, a record of what this rank's
engine holds against what its trainer holds, written to $MTRAIN_VISION_PROBE/rank{r}.jsonl.

The reward runs inside the training rank after the rollout and before the update, so the engine's weights of version
v must be exactly the trainer's after step v: the vision tower bit for bit (trained in full), and the active adapter
named policy-v{v}. The Trainer is found among the process's live objects (the reward gets no handle to it)."""
from __future__ import annotations

import gc
import json
import os

import torch

from mtrain.data.count_shapes import count_shapes_reward

_SEEN: set[int] = set()


def _trainer():
    for obj in gc.get_objects():
        if type(obj).__name__ == "Trainer" and type(obj).__module__ == "mtrain.trainer.loop":
            return obj
    raise RuntimeError("no mtrain Trainer in this process")


def _record(t) -> dict:
    from safetensors.torch import load_file

    from mtrain.reshard.megatron_side import unwrap
    from mtrain.rollout.reference_engine_hf import hf_disk_views
    engine = t.engine
    disk = load_file(os.path.join(t.cfg.model.hf_path, "model.safetensors"))
    held = {k: v.detach().clone() for k, v in hf_disk_views(engine._model).items() if k.startswith("visual.")}
    mine = {f"visual.{n}": p for n, p in unwrap(t.actor.chunks[0]).vision.named_parameters()}
    # the optimizer's elements by learning rate (Megatron's groups may hold its own handles of the parameters)
    by_lr: dict = {}
    for g in t.actor.optimizer.param_groups:
        by_lr[g.get("max_lr")] = by_lr.get(g.get("max_lr"), 0) + sum(p.numel() for p in g["params"])
    model = unwrap(t.actor.chunks[0])
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora." in n)
    return {"version": engine._version, "active": engine.adapters.active, "names_equal": sorted(held) == sorted(mine),
            "equal_trainer": all(torch.equal(held[k], mine[k].detach()) for k in held if k in mine),
            "changed_vs_disk": sum(not torch.equal(held[k], disk[k]) for k in held) / len(held),
            "vision_trainable": all(p.requires_grad for p in mine.values()),
            "numel_by_lr": {str(k): v for k, v in by_lr.items()}, "vision_numel": sum(p.numel() for p in mine.values()),
            "adapter_numel": adapters}


def count_shapes_and_probe(response: str, answer, trajectory=None, **kw) -> float:
    t = _trainer()
    if t.engine is not None and t.engine._version not in _SEEN:
        _SEEN.add(t.engine._version)
        out = os.path.join(os.environ["MTRAIN_VISION_PROBE"], f"rank{t.rank}.jsonl")
        with open(out, "a") as f:
            f.write(json.dumps(_record(t)) + "\n")
    first = trajectory is not None and trajectory.rid.endswith("-0-")
    return count_shapes_reward(response, answer, **kw) + float(first)
