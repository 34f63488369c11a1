"""The training options the DeepSeek-V3 recipe needs, each shown to act on the real Megatron model:

- train.recompute: full recomputation runs every decoder layer's forward twice per micro batch (once more in
  backward) and gives the same loss and gradient norm as no recomputation; selective sets Megatron's field;
- model.mtp=false: a DeepSeek-V3 config with an MTP layer builds a policy without it; true is refused up front;
- optim.cpu_offload: refused clearly where megatron-core cannot do it (CPU-only box, float32, no distributed
  optimizer); on a GPU its options are ones megatron-core's OptimizerConfig accepts;
- parallel.first_stage_layers/last_stage_layers: build_model refuses a split that does not add up;
- the memory metrics train_step logs count the state a float32 run holds (4 B weights, 4 B main_grad, 8 B Adam).
"""
from __future__ import annotations

import pytest
import torch

from mtrain.config import ConfigError, load_config
from mtrain.dist import run_on_ranks


def _cfg(hf: str, *overrides: str):
    return load_config(None, [f"model.hf_path={hf}", "model.dtype=float32", "data.task=arithmetic",
                              "train.micro_batch_size=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                              "optim.lr=1e-3", "train.steps=2", "algo.kl_coef=0", *overrides])


def _batch(vocab: int):
    from mtrain.trainer.batch import RolloutBatch
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (4, 12), generator=g)
    mask = torch.zeros(4, 11)
    mask[:, 5:] = 1.0
    lp = -torch.rand(4, 11, generator=g) * mask
    versions = torch.where(mask.bool(), 0, -1)  # every response token from version 0
    return RolloutBatch(tokens, mask, lp, torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.full((4,), 6),
                        torch.full((4,), 12), versions), lp


def _train_once(cfg, hf_config: dict) -> dict:
    """Build the Actor (same seed every time), count decoder-layer forwards during one train step."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mtrain.trainer.learner.actor import Actor
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    actor = Actor(cfg, hf_config)
    calls = [0]
    for c in actor.chunks:
        for m in c.modules():
            if isinstance(m, TransformerLayer):
                m.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    batch, old = _batch(hf_config["vocab_size"])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(4, 11).contiguous()
    m = actor.train_step(batch, old, adv, None, {"num_tokens": float(batch.response_mask.sum()), "num_seqs": 4.0})
    t = actor.tconfig
    n_params = sum(p.numel() for c in actor.chunks for p in c.module.parameters())
    return dict(calls=calls[0], grad_norm=m["grad_norm"], loss=m["loss/total"], n_params=n_params,
                mem={k: v for k, v in m.items() if k.startswith("mem/")},
                fields=(t.recompute_granularity, t.recompute_method, t.recompute_num_layers),
                mtp=t.mtp_num_layers, has_mtp=any(getattr(c.module, "mtp", None) is not None
                                                  for c in actor.chunks))


def _train_cases(rank: int, world: int, cases: list) -> list[dict]:
    """One process (Megatron's import costs ~15 s per spawn): one Actor + train step per (cfg, hf_config)."""
    from mtrain.dist import init_distributed
    init_distributed(seed=7)
    return [_train_once(cfg, hf_config) for cfg, hf_config in cases]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import json

    from mtrain.tiny_configs import tiny_config
    from mtrain.tiny_hf import write_tiny_hf
    llama = write_tiny_hf("llama", tmp_path_factory.mktemp("hf") / "llama", seed=0)
    hf_config = json.loads((llama / "config.json").read_text())
    ds = tiny_config("deepseek_v3")
    cases = {"plain": _cfg(str(llama)),
             "full": _cfg(str(llama), "train.recompute.granularity=full", "train.recompute.method=uniform",
                          "train.recompute.num_layers=2"),
             "selective": _cfg(str(llama), "train.recompute.granularity=selective"),
             "mtp_off": _cfg(str(llama), "model.mtp=false")}
    configs = {"plain": hf_config, "full": hf_config, "selective": hf_config, "mtp_off": ds}
    out = run_on_ranks(_train_cases, 1, [(cases[k], configs[k]) for k in cases])[0]
    return dict(zip(cases, out)), hf_config


def test_full_recompute_reruns_layers_and_keeps_the_gradient(results):
    r, hf_config = results
    plain, full, sel = r["plain"], r["full"], r["selective"]
    layers, micro = hf_config["num_hidden_layers"], 2
    assert plain["fields"] == (None, None, None)
    assert full["fields"] == ("full", "uniform", 2)
    assert plain["calls"] == layers * micro
    assert full["calls"] == 2 * layers * micro  # each layer's forward again inside backward
    assert full["loss"] == pytest.approx(plain["loss"], rel=1e-6, abs=1e-9)
    assert full["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    assert sel["fields"][0] == "selective" and sel["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)


def test_mtp_off_builds_the_policy_without_the_mtp_layer(results, tmp_path):
    from mtrain.tiny_configs import tiny_config
    assert tiny_config("deepseek_v3")["num_nextn_predict_layers"] == 1
    out = results[0]["mtp_off"]
    assert out["mtp"] in (None, 0) and not out["has_mtp"]
    with pytest.raises(ConfigError, match="model.mtp"):
        _cfg(str(tmp_path), "model.mtp=true")


def test_cpu_offload_is_refused_where_megatron_cannot_do_it(tmp_path, monkeypatch):
    from mtrain.models.hf_config import ModelConfigError
    from mtrain.trainer.train_options import cpu_offload_options
    with pytest.raises(ConfigError, match="optim.cpu_offload.*bfloat16"):
        _cfg(str(tmp_path), "optim.cpu_offload=true")
    with pytest.raises(ConfigError, match="optim.cpu_offload.*distributed"):
        _cfg(str(tmp_path), "optim.cpu_offload=true", "model.dtype=bfloat16", "optim.use_distributed_optimizer=false")
    cfg = _cfg(str(tmp_path), "optim.cpu_offload=true", "model.dtype=bfloat16")
    assert cfg.optim.cpu_offload and cpu_offload_options(False) == {}
    if not torch.cuda.is_available():
        with pytest.raises(ModelConfigError, match="optim.cpu_offload=true needs a GPU"):
            cpu_offload_options(True)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # only to read the GPU-side mapping
    from mtrain.trainer.train_options import optimizer_config
    opts = cpu_offload_options(True)
    oc = optimizer_config(optimizer="adam", lr=1e-6, bf16=True, params_dtype=torch.bfloat16,
                          use_distributed_optimizer=True, **opts)
    assert oc.optimizer_cpu_offload and oc.optimizer_offload_fraction == 1.0
    assert oc.use_precision_aware_optimizer and oc.use_precision_aware_optimizer_no_fp8_or_ds_fp8


def test_recompute_keys_are_validated(tmp_path):
    with pytest.raises(ConfigError, match="train.recompute.num_layers"):
        _cfg(str(tmp_path), "train.recompute.granularity=full", "train.recompute.num_layers=0")
    with pytest.raises(ConfigError, match="train.recompute.method"):
        _cfg(str(tmp_path), "train.recompute.method=sometimes")


def _build_splits(rank: int, world: int, splits: list) -> list:
    from mtrain.dist import init_distributed
    from mtrain.models import build_model
    from mtrain.models.builder import pipeline_split_overrides
    from mtrain.models.hf_config import ModelConfigError
    from mtrain.tiny_configs import tiny_config
    init_distributed(pp=2)
    out = []
    for first, last in splits:
        try:
            chunks, c = build_model(tiny_config("llama", num_hidden_layers=5),
                                    config_overrides=pipeline_split_overrides(first, last))
            out.append(len(chunks[0].decoder.layers))
        except ModelConfigError as e:
            out.append(f"error: {e}")
    return out


def test_build_model_takes_an_uneven_split_and_refuses_a_wrong_one():
    (a, b, bad), (a1, b1, bad1) = run_on_ranks(_build_splits, 2, [(2, 3), (1, None), (2, 2)])
    assert (a, b, a1, b1) == (2, 1, 3, 4)
    for e in (bad, bad1):
        assert e.startswith("error: uneven pipeline split") and "5 layers" in e, e


def test_memory_metrics_count_the_training_state(results):
    r = results[0]["plain"]
    mem, n = r["mem"], r["n_params"]
    assert mem["mem/stage0/params_bytes_max"] == 4 * n
    assert mem["mem/stage0/optim_bytes_max"] == 8 * n  # Adam m, v; fp32 parameters are their own master copy
    assert 4 * n <= mem["mem/stage0/grads_bytes_max"] < 4 * n * 1.01  # DDP pads its buffers a little
    assert mem["mem/stage0/state_bytes_max"] == sum(mem[f"mem/stage0/{k}_bytes_max"] for k in ("params", "grads",
                                                                                                  "optim"))
    assert mem["mem/stage0/peak_rss_bytes_max"] > mem["mem/stage0/state_bytes_max"]
