"""Rank bodies and the independent reference for tests/trainer/test_routing_replay.py (module-level functions, so
mtrain.dist.run_on_ranks can spawn them).

The reference is transformers' model in float64 with every MoE block's forward replaced by one written here: it takes
the expert ids as input (no top-k of its own), weights them with the router's own scores at those ids (softmax
renormalised over the top-k for Qwen3-MoE; sigmoid, renormalised and scaled for DeepSeek-V3) and runs the experts
from HF's weights. Nothing of Megatron or of the HF routing code is in it.
"""
from __future__ import annotations

import copy
import json
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
SHAPES = [(3, 4), (5, 9), (2, 3), (4, 12), (6, 3), (3, 7), (2, 5), (5, 2)]  # (prompt, response)
BUDGET = 24  # packed micro-batches: tokens per micro-batch


def random_routing(shape, rows: int, g: torch.Generator) -> torch.Tensor:
    """[rows, L, k] distinct random expert ids per token and MoE layer (zero rows on dense layers, as SGLang)."""
    out = torch.zeros((rows, shape.num_layers, shape.top_k), dtype=shape.dtype)
    for layer in shape.moe_layers:
        for t in range(rows):
            out[t, layer] = torch.randperm(shape.num_experts, generator=g)[:shape.top_k].to(shape.dtype)
    return out


def make_batch(hf_config: dict, seed: int = 0, routing=None):
    """A rollout batch whose completions carry `routing(prompt + output - 1)` ids (default: random ones)."""
    from mtrain.rollout.protocol import Completion
    from mtrain.rollout.routing import routing_shape
    from mtrain.trainer.batch import build_batch
    shape = routing_shape(hf_config)
    g = torch.Generator().manual_seed(seed)
    comps = []
    for i, (p, r) in enumerate(SHAPES):
        ids = torch.randint(3, hf_config["vocab_size"], (p + r,), generator=g).tolist()
        routed = random_routing(shape, p + r - 1, g) if routing is None else routing[i]
        comps.append(Completion(rid=str(i), prompt_ids=ids[:p], output_ids=ids[p:], logprobs=[-1.0] * r,
                                finish_reason="length", weight_version=0, routed_experts=routed))
    return build_batch(comps, torch.rand(len(SHAPES), generator=g).tolist(), pad_id=0, routing=shape)


# ---------------------------------------------------------------------------------------------- float64 reference
def _experts(block, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj  # [E, 2I, H], [E, H, I] (HF's weights)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def _forced_moe_forward(block, hidden: torch.Tensor) -> torch.Tensor:
    b, s, h = hidden.shape
    x = hidden.reshape(-1, h)
    ids = block.forced_ids.long()  # [s, k] for the one sequence being run
    logits = x @ block.gate.weight.T
    if block.kind == "qwen3_moe":
        w = torch.softmax(logits, -1).gather(1, ids)
        if block.norm:
            w = w / w.sum(-1, keepdim=True)
        out = _experts(block, x, ids, w)
    else:  # deepseek_v3: the expert bias only chooses experts; weights are the plain sigmoid scores
        w = torch.sigmoid(logits).gather(1, ids)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * block.scale
        out = _experts(block, x, ids, w) + block.shared_experts(x)
    return out.reshape(b, s, h)


def forced_reference_logprobs(hf_dir: str, batch) -> torch.Tensor:
    """[B, T-1] logprob of every real token, float64, every MoE layer using batch.routed_experts' ids."""
    from transformers import AutoModelForCausalLM
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64, attn_implementation="eager").eval()
    blocks = {}
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            mlp.kind, mlp.norm = cfg["model_type"], bool(cfg.get("norm_topk_prob"))
            mlp.scale = float(cfg.get("routed_scaling_factor", 1.0))
            mlp.forward = types.MethodType(_forced_moe_forward, mlp)
            blocks[i] = mlp
    out = torch.zeros(batch.response_mask.shape)
    with torch.no_grad():
        for r in range(batch.size):
            n = int(batch.seq_lens[r])
            for i, mlp in blocks.items():
                mlp.forced_ids = batch.routed_experts[r, :n, i]
            ids = batch.tokens[r, :n].unsqueeze(0)
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            out[r, :n - 1] = logp.gather(-1, ids[0, 1:, None])[:, 0].float()
    return out


def valid_positions(batch) -> torch.Tensor:
    return torch.arange(batch.tokens.shape[1] - 1)[None, :] < (batch.seq_lens[:, None] - 1)


# ---------------------------------------------------------------------------------------------- rank bodies
def _config(hf_dir: str, layout: dict, *extra: str):
    from mtrain.config import load_config
    return load_config(CONFIG, [f"model.hf_path={hf_dir}", "model.dtype=float32", "train.micro_batch_size=2",
                                "optim.use_distributed_optimizer=false", "algo.routing_replay=rollout", "algo.kl_coef=0",
                                *[f"parallel.{k}={v}" for k, v in layout.items()], *extra])


def _actor(cfg, hf_config: dict, rank: int, trainable: bool = True):
    from mtrain.layouts import model_layout
    from mtrain.trainer.learner.actor import Actor
    from mtrain.trainer.engines import weight_loader
    return Actor(cfg, hf_config, load_weights=weight_loader(cfg, model_layout(dict(hf_config, num_nextn_predict_layers=0),
                                                                                mtp=False), rank), trainable=trainable)


def _gathered_logprobs(actor, batch, packed_budget):
    """Whole-batch [B, T-1] logprobs on the last stage (each DP rank scores its rows), else None."""
    from megatron.core import parallel_state as ps
    from mtrain.trainer.batch import dp_rows
    actor.cfg.train.max_tokens_per_micro_batch = packed_budget
    sl = dp_rows(batch.seq_lens, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                 by_tokens=packed_budget is not None)
    lp = actor.logprobs(batch.select(sl))
    if lp is None:
        return None
    full = torch.zeros(batch.response_mask.shape)
    full[sl] = lp
    torch.distributed.all_reduce(full, group=ps.get_data_parallel_group())
    return full


def replay_equals_reference(rank: int, world: int, hf_dir: str, layout: dict, ref: torch.Tensor, train: bool) -> dict:
    """Logprob pass (padded and packed) against the forced-ids reference; with `train`: the training forward's PPO
    ratio against it (old logprobs = the reference), and gradients with full activation recompute equal to those
    without (recompute must replay the same ids in the backward)."""
    from megatron.core import parallel_state as ps
    from mtrain.dist import init_distributed
    init_distributed(**layout)
    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    batch = make_batch(hf_config)
    cfg = _config(hf_dir, layout)
    actor = _actor(cfg, hf_config, rank, trainable=train)
    valid = valid_positions(batch)
    res = {"last": ps.is_pipeline_last_stage(ignore_virtual=True)}
    for name, budget in (("padded", None), ("packed", BUDGET)):
        lp = _gathered_logprobs(actor, batch, budget)
        if lp is not None:
            res[f"lp_{name}_vs_ref"] = float((lp - ref).abs()[valid].max())
    actor.cfg.train.max_tokens_per_micro_batch = None
    if not train:
        return res
    from mtrain.trainer.batch import dp_rows
    sl = dp_rows(batch.seq_lens, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), by_tokens=False)
    mine = batch.select(sl)
    adv = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(2)) * batch.response_mask
    norms = {"num_tokens": float(batch.response_mask.sum()), "num_seqs": float(batch.size)}

    def grads(a):
        buffers = [(b, b.detach().clone()) for c in a.chunks for _, b in c.named_buffers()]
        outs = a.forward_backward(mine, ref[sl], adv[sl], None, norms)
        for b, saved in buffers:  # finalize_model_grads moves DeepSeek's expert bias: keep the model as it was
            b.copy_(saved)
        g = {f"{i}.{n}": p.main_grad.detach().clone() for i, c in enumerate(a.chunks) for n, p in c.named_parameters()
             if getattr(p, "main_grad", None) is not None}
        return outs, g

    outs, g_plain = grads(actor)
    if res["last"]:
        res["ratio_dev"] = max(max(abs(float(o["ppo/ratio_max"]) - 1), abs(float(o["ppo/ratio_min"]) - 1)) for o in outs)
    cfg_rc = copy.deepcopy(cfg)
    cfg_rc.train.recompute.granularity, cfg_rc.train.recompute.method, cfg_rc.train.recompute.num_layers = \
        "full", "uniform", 1
    _, g_rc = grads(_actor(cfg_rc, hf_config, rank))
    res["grad_max_abs"] = max(float(v.abs().max()) for v in g_plain.values())
    res["grad_recompute_diff"] = max(float((g_plain[k] - g_rc[k]).abs().max()) for k in g_plain)
    return res


# ---------------------------------------------------------------------------------------------- perturbed router
def perturbed_copy(src: Path, dst: Path, arch: str, seed: int = 0) -> Path:
    """A copy of the HF checkpoint whose routers *choose* differently but weight the chosen experts as before:
    DeepSeek-V3's expert bias (selection only) gets noise; Qwen3-MoE's expert 1 router row, which `tie_router_rows`
    made equal to expert 0's, moves by 1e-7 (ties between them break the other way, the scores barely move)."""
    import shutil
    from safetensors.torch import load_file, save_file
    dst.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
            continue
        state = load_file(f)
        for name, t in state.items():
            if arch == "deepseek_v3" and name.endswith("mlp.gate.e_score_correction_bias"):
                state[name] = t + torch.randn(t.shape, generator=g)
            elif arch == "qwen3_moe" and name.endswith("mlp.gate.weight"):
                t = t.clone()
                t[1] = t[1] + 1e-7 * torch.randn(t.shape[1], generator=g).sign()
                state[name] = t
        save_file(state, dst / f.name, metadata={"format": "pt"})
    return dst


def tie_router_rows(hf: Path) -> None:
    """Qwen3-MoE: expert 1's router row := expert 0's, in place (the two experts tie on every token)."""
    from safetensors.torch import load_file, save_file
    for f in hf.glob("*.safetensors"):
        state = load_file(f)
        for name, t in state.items():
            if name.endswith("mlp.gate.weight"):
                t[1] = t[0]
        save_file(state, f, metadata={"format": "pt"})


def perturbed_trainer(rank: int, world: int, hf_dir: str, completions: list) -> dict:
    """Engine completions (recorded on the unperturbed model) scored by the perturbed trainer, replay off and on."""
    from mtrain.dist import init_distributed
    from mtrain.rollout.routing import routing_shape
    from mtrain.trainer.batch import build_batch
    init_distributed()
    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    batch = build_batch(completions, [0.0] * len(completions), pad_id=0, routing=routing_shape(hf_config))
    mask = batch.response_mask.bool()
    out = {}
    for mode in ("off", "rollout"):
        cfg = _config(hf_dir, {}, f"algo.routing_replay={mode}")
        actor = _actor(cfg, hf_config, rank, trainable=False)
        lp = actor.logprobs(batch)
        out[f"gap_{mode}"] = float((lp - batch.engine_logprobs).abs()[mask].max())
        out[f"metrics_{mode}"] = actor.routing_metrics()
    return out


def bad_replay_data(rank: int, world: int, hf_dir: str, cases: list[str]) -> dict:
    """Actor.logprobs on batches whose routing is broken in one way each: per case the error and how many forwards
    ran; last, a good batch (the same Actor still works)."""
    from mtrain.dist import init_distributed
    init_distributed()
    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    actor = _actor(_config(hf_dir, {}), hf_config, rank, trainable=False)
    forwards = []
    for c in actor.chunks:
        c.register_forward_pre_hook(lambda *a: forwards.append(1))
    out = {}
    for what in [*cases, "good"]:
        batch = make_batch(hf_config)
        r = batch.routed_experts
        if what == "layers":
            batch.routed_experts = r[:, :, :-1]
        elif what == "tokens":
            batch.routed_experts = r[:, :-1]
        elif what == "expert_id":
            r[3, 5, r.shape[2] - 1, 0] = 250  # a MoE layer of a trained row, far outside the tiny model's experts
        elif what == "missing":
            batch.routed_experts = None
        forwards.clear()
        try:
            actor.logprobs(batch)
            out[what] = {"error": None, "forwards": len(forwards)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[what] = {"error": f"{type(e).__name__}: {e}", "forwards": len(forwards)}
    return out


# ---------------------------------------------------------------------------------------------- the RL loop
def loop_steps(rank: int, world: int, hf_dir: str, run_dir: str, extra: dict) -> list[dict]:
    """Trainer.train_step x 2 with the reference engine recording and the trainer replaying."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from loop_harness import base_overrides
    from mtrain.config import load_config
    from mtrain.trainer.loop import Trainer
    t = Trainer(load_config(CONFIG, base_overrides(Path(hf_dir), Path(run_dir), **extra)))
    try:
        return [t.train_step() for _ in range(2)]
    finally:
        t.close()


# ---------------------------------------------------------------------------------------------- trainer mode
def trainer_mode(rank: int, world: int, hf_dir: str, layout: dict) -> dict:
    """algo.routing_replay=trainer vs off: score a batch, move every router's expert bias (DeepSeek-V3: it changes
    which experts are chosen, not their weights), then update: the update's PPO ratio against the scoring pass."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router import TopKRouter
    from mtrain.dist import init_distributed
    from mtrain.trainer.batch import dp_rows
    init_distributed(**layout)
    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    batch = make_batch(hf_config)
    batch.routed_experts = None  # nothing from an engine: the trainer replays itself
    sl = dp_rows(batch.seq_lens, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), by_tokens=False)
    mine = batch.select(sl)
    adv = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(2)) * batch.response_mask
    norms = {"num_tokens": float(batch.response_mask.sum()), "num_seqs": float(batch.size)}
    out = {"last": ps.is_pipeline_last_stage(ignore_virtual=True)}
    for mode in ("off", "trainer"):
        cfg = _config(hf_dir, layout, f"algo.routing_replay={mode}", "train.recompute.granularity=full")
        actor = _actor(cfg, hf_config, rank)
        old = actor.logprobs(mine)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for c in actor.chunks:
                for m in c.modules():
                    if isinstance(m, TopKRouter) and m.expert_bias is not None:
                        m.expert_bias.add_(torch.randn(m.expert_bias.shape, generator=g).to(m.expert_bias))
        outs = actor.forward_backward(mine, old if old is not None else torch.zeros(mine.response_mask.shape),
                                      adv[sl], None, norms)
        if out["last"]:
            out[f"ratio_dev_{mode}"] = max(max(abs(float(o["ppo/ratio_max"]) - 1), abs(float(o["ppo/ratio_min"]) - 1))
                                           for o in outs)
        try:  # an update without a scoring pass before it
            actor.forward_backward(mine, torch.zeros(mine.response_mask.shape), adv[sl], None, norms)
            out[f"second_update_{mode}"] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[f"second_update_{mode}"] = f"{type(e).__name__}: {e}"
    return out
