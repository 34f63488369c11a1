"""optim.cpu_offload (megatron-core's HybridDeviceOptimizer inside the distributed optimizer) through mtrain's real
Trainer on CPU: 2 GRPO steps with engine.offload_train, a checkpoint save, a resume from it, mcore-to-hf export.

megatron-core's hybrid optimizer decides what to offload by `param.is_cuda` and then runs entirely on host
tensors (pinned copies, torch's CPU AdamW, hooks copying results back). On a CPU-only box every tensor reports
is_cuda False, so nothing would be offloaded and its host-copy maps stay empty. This test makes the one change
that emulates a device: inside the run, bf16 tensors (the model's weights, their optimizer shards) report
is_cuda True and `pin_memory()` returns the tensor (a CPU-only torch cannot pin). Everything else is megatron's
and mtrain's own code: the hybrid optimizer clones the shards to fp32 host copies, steps them with torch's
fused CPU AdamW and copies them back, and the distributed optimizer saves and loads its state.
"""
from __future__ import annotations

import json

import pytest
import torch

from loop_harness import CONFIG, base_overrides
from mtrain.dist import run_on_ranks

pytestmark = pytest.mark.slow


class _Bf16IsDevice(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is torch.Tensor.is_cuda and getattr(func, "__name__", "") == "__get__":
            return args[0].dtype == torch.bfloat16
        if func is torch.Tensor.pin_memory:
            return args[0]
        return func(*args, **(kwargs or {}))


def _run(rank, world, hf, run_dir, steps, resume):
    import mtrain.trainer.learner.actor as actor_mod
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from mtrain.config import load_config
    from mtrain.trainer.loop import Trainer
    actor_mod.cpu_offload_options = lambda on: dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                                                    use_precision_aware_optimizer=True) if on else {}
    with _Bf16IsDevice():
        t = Trainer(load_config(CONFIG, base_overrides(hf, run_dir, **{
            "parallel.tp": 1, "model.dtype": "bfloat16", "optim.cpu_offload": "true", "engine.offload_train": "true",
            "train.steps": steps, "train.resume": resume, "train.save_interval": 0})))
        inner = [s.optimizer for s in getattr(t.actor.optimizer, "chained_optimizers", [t.actor.optimizer])]
        out = {"hybrid": all(isinstance(o, HybridDeviceOptimizer) for o in inner),
               "offloaded": sum(len(o.gpu_params_map_cpu_copy) for o in inner), "start": t.step}
        t.run()  # the user's loop: steps, engine.offload_train around each rollout, the save at the last step
        out["records"] = [r for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
                          if "grad_norm" in r]
        out["host_state"] = all(v.device.type == "cpu" and v.dtype == torch.float32
                                for o in inner for st in o.state.values() for k, v in st.items() if k != "step")
        t.close()
    return out


def test_hybrid_optimizer_trains_saves_resumes_and_exports(tmp_path):
    from mtrain.converters.mcore_to_hf import mcore_to_hf
    from mtrain.tiny_hf import write_tiny_hf
    from mtrain.trainer.checkpoint import checkpoint_problem
    hf = write_tiny_hf("llama", tmp_path / "hf", seed=0)
    run = tmp_path / "run"
    first = run_on_ranks(_run, 1, hf, run, 2, "never", timeout=240)[0]
    assert first["hybrid"] and first["offloaded"] > 0 and first["host_state"]
    assert len(first["records"]) == 2
    assert all(r.get("offload/bytes", 1) > 0 for r in first["records"])
    ckpt = run / "checkpoints" / "step_2"
    assert checkpoint_problem(ckpt) is None
    resumed = run_on_ranks(_run, 1, hf, run, 3, "auto", timeout=240)[0]
    assert resumed["start"] == 2 and len(resumed["records"]) == 3 and resumed["host_state"]  # the log appends
    out = mcore_to_hf(ckpt / "mcore", tmp_path / "export", hf_config_dir=hf)
    from safetensors.torch import load_file
    exported = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    start = {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(exported) == sorted(start)
    assert any(not torch.equal(exported[k].float(), start[k].float()) for k in start)  # trained weights
