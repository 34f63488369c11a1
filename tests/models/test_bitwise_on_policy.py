"""numerics.on_policy=bitwise: the logprob the reference engine returns for each sampled token equals, bit for bit
(torch.equal), the one the trainer's Megatron model recomputes from the same weights, for a tiny Llama, a tiny Qwen2
(q/k/v biases) and a tiny Qwen3 with random weights (norms included), float32 and bf16: trainer TP1 and TP2 against engine TP1 and TP2.
For a tiny Qwen3-MoE (a dense layer, then a MoE layer with top-4 of 8 experts) the experts each side chose for every
token are equal too, without routing replay.

The default mode is checked too, as the reason for the mode: there the two sides differ (but stay close)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtrain.dist import run_on_ranks

REPO = Path(__file__).resolve().parents[2]

ARCHS = ("llama", "qwen2", "qwen3")  # qwen2: q/k/v biases
MOE = ("qwen3_moe",)
DTYPES = ("float32", "bfloat16")
PROMPTS = ([5, 17, 33, 2, 91, 40], [7, 7, 120, 64, 3, 19], [11, 42, 8])  # two prompt lengths: two decode groups


def _config(arch: str) -> dict:
    from mtrain.tiny_configs import numerics_config
    # power-of-two row-parallel inputs (o_proj: heads x head_dim, down_proj: intermediate), as TP2 bitwise needs;
    # Qwen3-MoE: layer 0 dense (mlp_only_layers), layer 1 MoE with experts of 32; top-4 so that the fixed order of
    # the combination matters (two terms add the same in either order)
    extra = dict(num_experts_per_tok=4) if arch in MOE else {}
    return numerics_config(arch, intermediate_size=128, num_hidden_layers=2, **extra)


def _engine_rollout(arch: str, dtype: torch.dtype, engine_tp: int, bitwise: bool):
    """(HF model, completions) of the reference engine on the HF model's random weights."""
    from hf_reference import make_hf_model

    from mtrain.rollout.protocol import Request, SamplingParams
    from mtrain.rollout.reference_engine import ReferenceEngine
    from mtrain.rollout.reference_engine_bitwise import BitwiseReferenceEngine

    cfg = _config(arch)
    hf = make_hf_model(cfg, seed=3)
    engine = (BitwiseReferenceEngine(cfg, dtype=dtype, tp_size=engine_tp, record_routing=arch in MOE) if bitwise
              else ReferenceEngine(cfg, dtype=dtype))
    sd = hf.state_dict()
    with torch.no_grad():  # the same HF classes: the in-memory names (MoE experts fused) match one to one
        for name, t in engine._model.state_dict().items():
            t.copy_(sd[name].to(dtype))
    params = SamplingParams(max_new_tokens=5, temperature=0.9, seed=11)
    reqs = [Request(rid=f"r{i}", prompt_ids=list(p), params=params) for i, p in enumerate(PROMPTS)]
    out = engine.generate(reqs)
    engine.shutdown()
    return hf, cfg, out


def _trainer_logprobs(hf, cfg: dict, dtype: torch.dtype, completions, bitwise: bool, routes: list | None = None
                      ) -> list[torch.Tensor]:
    """The trainer's recomputed logprob of every sampled token (Megatron model, TP of the live parallel_state);
    `routes` gets each completion's expert ids [tokens, layers, k] (zeros for dense layers), read from the bitwise
    MoE layers after the forward."""
    from hf_reference import hf_to_megatron_tp1
    from megatron.core import parallel_state as ps

    from mtrain.kernels import bitwise_ops
    from mtrain.models import build_model, forward_logits
    from mtrain.models.token_logprobs import token_logprobs

    chunks, _ = build_model(cfg, params_dtype=dtype, on_policy="bitwise" if bitwise else "off")
    full = hf_to_megatron_tp1(hf, cfg, {k: v for k, v in _tp1_state(cfg, dtype, bitwise).items()})
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    chunks[0].load_state_dict(_shard(full, chunks[0].state_dict(), tp, rank, cfg))
    out = []
    for c in completions:
        tokens = torch.tensor([c.prompt_ids + c.output_ids])
        logits = forward_logits(chunks, tokens)[0]  # [s, vocab] float32 (full vocabulary, gathered)
        if routes is not None:
            layers = chunks[0].decoder.layers
            k = cfg["num_experts_per_tok"]
            routes.append(torch.stack([l.mlp.mtrain_routes[:, 0] if hasattr(l.mlp, "mtrain_routes") else
                                       torch.zeros(tokens.shape[1], k, dtype=torch.long) for l in layers], dim=1))
        n = len(c.prompt_ids)
        pos = logits[n - 1:-1]
        target = torch.tensor(c.output_ids)
        if bitwise:
            out.append(bitwise_ops.token_logprobs(pos, target, 0.9))
        else:
            out.append(token_logprobs(pos, target, vocab=pos.shape[-1], temperature=0.9))
    return out


def _tp1_state(cfg: dict, dtype: torch.dtype, bitwise: bool) -> dict:
    """A TP1 Megatron state dict (names and padded shapes) of this config, built outside parallel_state's TP."""
    from mtrain.models.hf_config import map_hf_config, padded_vocab_size

    names = {}
    mapped = map_hf_config(cfg)
    c = mapped.config_kwargs
    h, hd = c["hidden_size"], c["kv_channels"]
    q, g, f = c["num_attention_heads"], c["num_query_groups"], c["ffn_hidden_size"]
    vocab = padded_vocab_size(mapped.vocab_size, 1)
    names["embedding.word_embeddings.weight"] = torch.zeros(vocab, h)
    for i in range(c["num_layers"]):
        p = f"decoder.layers.{i}."
        names[p + "input_layernorm.weight"] = torch.zeros(h)
        names[p + "self_attention.linear_qkv.weight"] = torch.zeros((q + 2 * g) * hd, h)
        if c.get("add_qkv_bias"):
            names[p + "self_attention.linear_qkv.bias"] = torch.zeros((q + 2 * g) * hd)
        names[p + "self_attention.linear_proj.weight"] = torch.zeros(h, q * hd)
        if c.get("qk_layernorm"):
            names[p + "self_attention.q_layernorm.weight"] = torch.zeros(hd)
            names[p + "self_attention.k_layernorm.weight"] = torch.zeros(hd)
        names[p + "pre_mlp_layernorm.weight"] = torch.zeros(h)
        freq = c.get("moe_layer_freq")
        if isinstance(freq, list) and freq[i]:  # Megatron's MoE names; expert TP splits fc1/fc2 as the dense MLP's
            e, fe = c["num_moe_experts"], c["moe_ffn_hidden_size"]
            names[p + "mlp.router.weight"] = torch.zeros(e, h)
            for j in range(e):
                names[p + f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = torch.zeros(2 * fe, h)
                names[p + f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = torch.zeros(h, fe)
            continue
        names[p + "mlp.linear_fc1.weight"] = torch.zeros(2 * f, h)
        names[p + "mlp.linear_fc2.weight"] = torch.zeros(h, f)
    names["decoder.final_layernorm.weight"] = torch.zeros(h)
    if not mapped.model_kwargs.get("share_embeddings_and_output_weights"):
        names["output_layer.weight"] = torch.zeros(vocab, h)
    return names


def _shard(full: dict, local: dict, tp: int, rank: int, cfg: dict) -> dict:
    """This TP rank's slice of a TP1 state dict: Megatron's column/row layouts (qkv per query group, fc1 gate|up)."""
    out = {}
    for name, target in local.items():
        if name not in full or "_extra_state" in name:
            out[name] = target
            continue
        t = full[name]
        if tp > 1 and "linear_qkv." in name:
            t = t.view(tp, -1, *t.shape[1:])[rank]  # rows (and biases) are grouped by query group, split evenly
        elif tp > 1 and "linear_fc1.weight" in name:
            gate, up = t.chunk(2)
            t = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        elif tp > 1 and ("linear_proj.weight" in name or "linear_fc2.weight" in name):
            t = t.chunk(tp, dim=1)[rank]
        elif tp > 1 and ("word_embeddings" in name or "output_layer" in name):
            t = t.chunk(tp)[rank]
        out[name] = t.to(target.dtype).clone()
    return out


def _compare(rank: int, world: int, engine_tps: tuple, bitwise: bool, archs: tuple = ARCHS,
             dtypes: tuple = DTYPES) -> dict:
    """{(arch, dtype, engine tp): (logprobs torch.equal, max |diff|, sampled tokens, routes equal or None for dense,
    MoE layers' (token, layer) rows compared)}."""
    from mtrain.dist import init_distributed
    init_distributed(tp=world)
    result = {}
    for arch in archs:
        for dname in dtypes:
            dtype = getattr(torch, dname)
            for etp in engine_tps:
                hf, cfg, completions = _engine_rollout(arch, dtype, etp, bitwise)
                routes = [] if bitwise and arch in MOE else None
                mine = _trainer_logprobs(hf, cfg, dtype, completions, bitwise, routes)
                theirs = [torch.tensor(c.logprobs, dtype=torch.float32) for c in completions]
                same_routes, rows = None, 0
                if routes is not None:  # the engine has no row for the last sampled token (never fed forward)
                    pairs = [(r[:len(c.prompt_ids) + len(c.output_ids) - 1], c.routed_experts.long())
                             for r, c in zip(routes, completions)]
                    same_routes = all(torch.equal(a, b) for a, b in pairs)
                    rows = sum(int((b != 0).any(-1).sum()) for _, b in pairs)
                result[(arch, dname, etp)] = (all(torch.equal(a, b) for a, b in zip(mine, theirs)),
                                              max(float((a - b).abs().max()) for a, b in zip(mine, theirs)),
                                              sum(len(c.output_ids) for c in completions), same_routes, rows)
    return result


def _check(results: dict) -> None:
    for key, (equal, diff, n, same_routes, rows) in results.items():
        assert n > 0, key
        assert equal, f"{key}: trainer and engine logprobs differ (max |diff| {diff:.3e})"
        if key[0] in MOE:
            assert rows > 0 and same_routes, f"{key}: the engine's and the trainer's experts differ ({rows} rows)"


def test_bitwise_trainer_tp1_equals_engine_tp1():
    _check(run_on_ranks(_compare, 1, (1,), True, timeout=900)[0])


def test_bitwise_moe_trainer_tp1_equals_engine_tp1():
    """Tiny Qwen3-MoE, float32 and bf16: the same experts for every token and the same logprobs, no replay."""
    _check(run_on_ranks(_compare, 1, (1,), True, MOE, timeout=900)[0])


def _state_layout(rank: int, world: int) -> dict:
    """{on_policy: (state dict names and shapes, sharded state dict keys)} of the tiny Qwen3-MoE, TP1."""
    from mtrain.dist import init_distributed
    from mtrain.models import build_model
    init_distributed(tp=world)
    out = {}
    for mode in ("off", "bitwise"):
        chunks, _ = build_model(_config("qwen3_moe"), params_dtype=torch.float32, on_policy=mode)
        out[mode] = ({k: tuple(v.shape) for k, v in chunks[0].state_dict().items() if "_extra_state" not in k},
                     sorted(k for k in chunks[0].sharded_state_dict() if "_extra_state" not in k))
        out[mode + "_mlp"] = type(chunks[0].decoder.layers[1].mlp).__name__
    return out


def test_bitwise_moe_keeps_megatron_parameters():
    """The bitwise MoE layer keeps Megatron's parameter names, shapes and sharded state dict (checkpoints, converters
    and weight sync see the same model)."""
    out = run_on_ranks(_state_layout, 1, timeout=300)[0]
    assert out["bitwise_mlp"] == "BitwiseMoELayer" and out["off_mlp"] == "MoELayer"
    assert any(".mlp.experts.local_experts.7.linear_fc2.weight" in k for k in out["off"][0])
    assert out["bitwise"] == out["off"]


def _side_model_kernels(rank: int, world: int) -> dict:
    """{model: (Actor.bitwise, MLP class of layer 1)} for the policy, the KL reference and PPO's critic of a bitwise
    run (tiny Qwen3-MoE, one rank)."""
    from mtrain.config import load_config
    from mtrain.dist import init_distributed
    from mtrain.trainer.learner.actor import Actor
    from mtrain.trainer.learner.critic import Critic
    init_distributed(tp=world)
    cfg = load_config(REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml",
                      ["model.hf_path=unused", "numerics.on_policy=bitwise"])
    hf = _config("qwen3_moe")
    models = {"policy": Actor(cfg, hf), "reference": Actor(cfg, hf, trainable=False),
              "critic": Critic(cfg, hf, load_weights=lambda chunks: None)}
    layers = {k: getattr(m.chunks[0], "module", m.chunks[0]).decoder.layers for k, m in models.items()}  # DDP
    return {k: (m.bitwise, type(layers[k][1].mlp).__name__) for k, m in models.items()}


def test_bitwise_is_the_policys_alone():
    """The KL reference (and a teacher, built the same way) and the critic meet the policy only in a loss term: they
    keep the default kernels (docs/design-on-policy.md, "The scoring pass")."""
    out = run_on_ranks(_side_model_kernels, 1, timeout=300)[0]
    assert out == {"policy": (True, "BitwiseMoELayer"), "reference": (False, "MoELayer"),
                   "critic": (False, "MoELayer")}, out


def test_default_mode_differs_but_is_close():
    """Without the mode the kernels differ: not all equal, all within float32/bf16 noise (the gap the mode closes)."""
    results = run_on_ranks(_compare, 1, (1,), False, timeout=900)[0]
    assert not all(r[0] for r in results.values()), "the default mode is already bitwise: the mode is moot"
    for key, (_, diff, *_) in results.items():
        assert diff < (1e-3 if "float32" in key else 0.2), f"{key}: default-mode gap {diff} is not numerical noise"


def _torchrun(args: list[str], cwd, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests' / 'models'}")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


def test_bitwise_trainer_tp2_equals_engine_tp1_and_tp2(tmp_path):
    """torchrun, 2 ranks (gloo), trainer TP2; engines TP1 and TP2 (the latter split as 2 ranks would)."""
    _torchrun([__file__, str(tmp_path / "result"), "dense"], tmp_path, timeout=900)
    for rank in (0, 1):
        _check(torch.load(tmp_path / f"result.{rank}", weights_only=False))


def test_bitwise_moe_trainer_tp2_equals_engine_tp1_and_tp2(tmp_path):
    """The same for the tiny Qwen3-MoE: trainer TP2 (expert TP 2, EP 1: every expert's fc1 columns and fc2 K split
    over the ranks) against engines TP1 and TP2; routes and logprobs equal."""
    _torchrun([__file__, str(tmp_path / "result"), "moe"], tmp_path, timeout=900)
    for rank in (0, 1):
        _check(torch.load(tmp_path / f"result.{rank}", weights_only=False))


# the tiny Qwen3-MoE of the routing-replay tests (4 experts, top-2, every layer MoE, experts of 32), 2 layers
RUN_MODELS = {"llama": {"intermediate_size": 128}, "qwen3_moe": {"num_hidden_layers": 2}}


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("qwen3_moe", "float32"),  # 30-50 s each
                                        pytest.param("llama", "bfloat16", marks=pytest.mark.slow),
                                        pytest.param("qwen3_moe", "bfloat16", marks=pytest.mark.slow)])
def test_bitwise_run_tp2_logprob_diff_is_zero(tmp_path, arch, dtype):
    """`torchrun --nproc-per-node 2 -m mtrain train ... numerics.on_policy=bitwise parallel.tp=2`, 2 GRPO steps:
    logprob_diff/max_abs is exactly 0 at every step (Qwen3-MoE: without routing replay)."""
    from mtrain.tiny_hf import write_tiny_hf

    hf = write_tiny_hf(arch, tmp_path / "hf", seed=0, overrides=RUN_MODELS[arch])
    run = tmp_path / f"run_{dtype}"
    _torchrun(["-m", "mtrain", "train", str(REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"),
               f"model.hf_path={hf}", f"train.run_dir={run}", "train.steps=2", "train.save_interval=0",
               "train.eval_interval=0", "parallel.tp=2", "engine.kind=reference", f"model.dtype={dtype}",
               # packed micro-batches: Megatron hands the core attention THD tensors [t, heads, hn]
               "train.max_tokens_per_micro_batch=96", "numerics.on_policy=bitwise"], tmp_path, timeout=900)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = {r["step"]: r for r in recs if "weight_version" in r}
    assert sorted(steps) == [1, 2], (arch, dtype)
    for step, r in steps.items():
        assert r["logprob_diff/max_abs"] == 0.0, (arch, dtype, step, r["logprob_diff/max_abs"])
        # synchronous rollout: no scoring pass; the gap above is the first update's forward against the engine
        assert r["logprobs/scored"] == 0.0, (arch, dtype, step)


def test_bitwise_scores_older_versions_itself(tmp_path):
    """rollout.async=one_step with bitwise: step 1 trains on tokens of the weights it holds (no scoring pass, the
    update's forward gap exactly 0); from step 2 the tokens are one version old, so the trainer scores them itself,
    and the gap, now between two weight versions, is not 0."""
    from mtrain.tiny_hf import write_tiny_hf

    hf = write_tiny_hf("llama", tmp_path / "hf", seed=0, overrides=RUN_MODELS["llama"])
    run = tmp_path / "run"
    _torchrun(["-m", "mtrain", "train", str(REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"),
               f"model.hf_path={hf}", f"train.run_dir={run}", "train.steps=3", "train.save_interval=0",
               "train.eval_interval=0", "parallel.tp=2", "engine.kind=reference", "model.dtype=float32",
               "rollout.async=one_step", "numerics.on_policy=bitwise"], tmp_path, timeout=900)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = {r["step"]: r for r in recs if "weight_version" in r}
    assert sorted(steps) == [1, 2, 3]
    assert steps[1]["logprobs/scored"] == 0.0 and steps[1]["logprob_diff/max_abs"] == 0.0
    for step in (2, 3):
        assert steps[step]["logprobs/scored"] == 1.0, step
        assert steps[step]["logprob_diff/max_abs"] > 0.0, step


def test_bitwise_on_sglang_is_refused_only_where_the_gpu_kernels_cannot_be_bitwise():
    from mtrain.config import ConfigError, load_config

    cfg = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
    assert load_config(cfg, ["numerics.on_policy=bitwise", "engine.kind=sglang"]).numerics.on_policy == "bitwise"
    with pytest.raises(ConfigError, match="numerics.on_policy: bitwise on SGLang needs parallel.tp=1"):
        load_config(cfg, ["numerics.on_policy=bitwise", "engine.kind=sglang", "parallel.tp=2"])
    with pytest.raises(ConfigError, match="numerics.on_policy: bitwise engines run at engine.tp=1"):
        load_config(cfg, ["numerics.on_policy=bitwise", "engine.kind=sglang", "engine.tp=2", "parallel.tp=2"])
    with pytest.raises(ConfigError, match="numerics.on_policy"):
        load_config(REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml", ["numerics.on_policy=exact"])


def test_bitwise_refuses_expert_parallelism_in_one_line():
    from mtrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="bitwise is not built for expert parallelism: .* got parallel.ep=2"):
        load_config(REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml",
                    ["numerics.on_policy=bitwise", "engine.kind=reference", "parallel.ep=2"])


if __name__ == "__main__":  # one rank of the torchrun launch above: trainer TP2 against engines TP1 and TP2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.save(_compare(rank, world, (1, 2), True, MOE if sys.argv[2] == "moe" else ARCHS), f"{sys.argv[1]}.{rank}")
