"""A LoRA policy in the real loop (2 gloo ranks, PP2, tiny Llama with tied embeddings, the CPU reference engine).

Checks: only the adapters are trainable and in the optimizer; the engine starts from the disk weights and then
receives only A/B as a named adapter per version (policy-v{step}; the previous one unloaded), base weights on the
engine bit-identical to disk after every step; the adapters on the engine move; the engine-vs-trainer logprob gap
stays at the full-fine-tuning level (<= 1e-5, float32).
"""
from __future__ import annotations

import pytest
import torch

from loop_harness import CONFIG, base_overrides
from mtrain.dist import run_on_ranks

TARGETS = "qkv,o_proj,gate_up,down"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    return write_tiny_hf("llama", tmp_path_factory.mktemp("hf") / "llama", seed=0)


def _steps(rank, world, hf, run_dir):
    from safetensors.torch import load_file

    from mtrain.config import load_config
    from mtrain.reshard.megatron_side import unwrap
    from mtrain.trainer.loop import Trainer

    cfg = load_config(CONFIG, base_overrides(hf, run_dir, **{
        "parallel.tp": 1, "parallel.pp": 2, "model.lora.targets": TARGETS, "model.lora.rank": 4,
        "model.lora.alpha": 8, "model.lora.lr": 1e-3}))
    t = Trainer(cfg)
    params = [p for c in t.actor.chunks for n, p in unwrap(c).named_parameters()]
    trainable = [n for c in t.actor.chunks for n, p in unwrap(c).named_parameters() if p.requires_grad]
    in_opt = sum(p.numel() for g in t.actor.optimizer.param_groups for p in g["params"])
    out = {"records": [], "only_adapters": bool(trainable) and all(".lora." in n for n in trainable),
           "opt_numel": in_opt, "adapter_numel": sum(p.numel() for p in params if p.requires_grad)}
    if rank == 0:
        disk = {}
        for f in sorted(hf.glob("*.safetensors")):
            disk.update(load_file(f))
        views = lambda: {**{k: v.detach().clone() for k, v in t.engine._views.items()},  # noqa: E731
                         **{k: v.clone() for k, v in t.engine.adapter_state().items()}}
        start = views()
        out["start_base_equal_disk"] = all(torch.equal(start[k], disk[k]) for k in disk)
        out["adapters"] = [(t.engine.adapters.active, t.engine._adapter_names())]
    for _ in range(3):
        out["records"].append(t.train_step())
        if rank == 0:
            now = views()
            out.setdefault("base_equal_disk", []).append(all(torch.equal(now[k], disk[k]) for k in disk))
            out["adapters"].append((t.engine.adapters.active, t.engine._adapter_names()))
            lora = [k for k in now if ".lora_" in k]
            out.setdefault("lora_changed", []).append(sum(not torch.equal(now[k], start[k]) for k in lora) / len(lora))
    t.close()
    return out


def test_lora_loop_syncs_adapters_only(tiny_llama, tmp_path):
    from pathlib import Path
    res = run_on_ranks(_steps, 2, Path(tiny_llama), tmp_path / "run", timeout=300)
    lead = res[0]
    for r in res:
        assert r["only_adapters"] and r["opt_numel"] == r["adapter_numel"] > 0, r
    assert lead["start_base_equal_disk"]
    assert all(lead["base_equal_disk"]), lead["base_equal_disk"]
    assert lead["lora_changed"][-1] > 0.5, lead["lora_changed"]
    # one adapter loaded at a time, named by the weight version; the previous one is gone
    assert lead["adapters"] == [(f"policy-v{v}", [f"policy-v{v}"]) for v in range(4)], lead["adapters"]
    for step, r in enumerate(lead["records"], 1):
        assert r["weight_version"] == step
        assert r["sync/adapters_only"] == 1.0
        assert r["logprob_diff/max_abs"] <= 1e-5, (step, r["logprob_diff/max_abs"])
        assert r["grad_norm"] > 0


def _save_then_resume(rank, world, hf, run_dir, first: dict, second: dict):
    from mtrain.config import load_config
    from mtrain.trainer.loop import Trainer

    lora = {"model.lora.targets": TARGETS, "model.lora.rank": 4, "model.lora.alpha": 8, "model.lora.lr": 1e-3}
    views = lambda t: {k: v.clone() for k, v in t.engine.adapter_state().items()}  # noqa: E731
    t = Trainer(load_config(CONFIG, base_overrides(hf, run_dir, **{**lora, **first, "train.steps": 2,
                                                                     "train.save_interval": 2})))
    t.run()  # 2 steps, the checkpoint of step 2 saved as the loop saves it
    saved = views(t) if rank == 0 else None
    t.close()
    t = Trainer(load_config(CONFIG, base_overrides(hf, run_dir, **{**lora, **second, "train.steps": 3})))
    out = {"step": t.step}
    if rank == 0:
        now = views(t)
        out["same"] = sorted(now) == sorted(saved) and all(torch.equal(now[k], saved[k]) for k in now)
        out["n"] = len(now)
    out["record"] = t.train_step()
    t.close()
    return out


@pytest.mark.slow  # two trainers, 3 steps: ~50 s
@pytest.mark.parametrize("first,second", [({"parallel.tp": 1, "parallel.pp": 2}, {"parallel.tp": 2, "parallel.pp": 1})],
                         ids=["pp2-to-tp2"])
def test_lora_checkpoint_resumes_at_another_layout(tiny_llama, tmp_path, first, second):
    from pathlib import Path
    res = run_on_ranks(_save_then_resume, 2, Path(tiny_llama), tmp_path / "run", first, second, timeout=400)
    lead = res[0]
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "mcore" / "lora.json").is_file()
    assert lead["step"] == 2 and lead["same"] and lead["n"] > 0, lead
    r = lead["record"]
    assert r["weight_version"] == 3 and r["logprob_diff/max_abs"] <= 1e-5 and r["sync/adapters_only"] == 1.0


def test_lora_stream_torchrun(tiny_llama, tmp_path):
    """rollout.async=stream with LoRA under torchrun (2 gloo ranks, TP2): each sync goes into the running generation
    (requests paused in place keep the adapter they started on, tests/rollout/test_lora_adapters.py), every trained
    token's version is within max_staleness=1 of its step, nothing is aborted, and the policy leaves the base."""
    from loop_harness import launch, train_records
    run, steps = tmp_path / "run", 4
    launch(base_overrides(tiny_llama, run, **{"rollout.async": "stream", "train.steps": steps,
                                              "rollout.max_staleness": 1, "rollout.max_new_tokens": 24,
                                              "model.lora.targets": TARGETS, "model.lora.rank": 4,
                                              "model.lora.alpha": 8, "model.lora.lr": 1e-2}), tmp_path, timeout=400)
    recs = train_records(run)
    assert sorted(recs) == list(range(1, steps + 1))
    for s in range(1, steps + 1):
        r = recs[s]
        lags = {int(k.rsplit("_", 1)[1]): v for k, v in r.items() if k.startswith("rollout/tokens_lag_")}
        assert lags and 0 <= min(lags) and max(lags) <= 1, (s, lags)
        assert r["rollout/stale_groups_dropped"] == 0.0 and r["rollout/aborted_per_update"] == 0.0
        assert r["rollout/pause_s"] > 0.0 and r["sync/adapters_only"] == 1.0
    assert any(recs[s]["rollout/offpolicy_token_frac"] > 0 for s in range(2, steps + 1))
    assert recs[steps]["kl/mean"] > 1e-3, recs[steps]["kl/mean"]


def test_lora_on_experts_torchrun(tmp_path):
    """LoRA on attention and every routed expert of a tiny Qwen3-MoE (EP2 over 2 gloo ranks, torchrun) with the CPU
    reference engine, whose HF model holds the experts fused: every sync reaches the engine by the trainer's
    per-expert names, and the engine-vs-trainer gap stays <= 1e-5 while the policy leaves the base."""
    from loop_harness import launch, train_records
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("qwen3_moe", tmp_path / "hf", seed=0)
    run = tmp_path / "run"
    launch(base_overrides(hf, run, **{"parallel.tp": 1, "parallel.ep": 2, "train.steps": 3,
                                      "model.lora.targets": "qkv,experts", "model.lora.rank": 4,
                                      "model.lora.alpha": 8, "model.lora.lr": 1e-2}), tmp_path, timeout=600)
    recs = train_records(run)
    assert sorted(recs) == [1, 2, 3]
    for s in (1, 2, 3):
        assert recs[s]["sync/adapters_only"] == 1.0
        assert recs[s]["logprob_diff/max_abs"] <= 1e-5, (s, recs[s]["logprob_diff/max_abs"])
    assert recs[3]["kl/mean"] > 1e-3, recs[3]["kl/mean"]
