"""Rank body and references for tests/trainer/test_cp_combined.py: context parallelism combined with TP, PP or
EP, padded and packed, through the real Actor; gradients gathered back to full, HF-named tensors with the same
resharding plan the weight sync uses, and transformers (float64) as the independent reference."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from packing_worker import BUDGET, CONFIG, make_batch

ALGOS = [  # every loss term the trainer has: PPO clip, KL, entropy (sequence-mean), TIS (token-mean)
    ("grpo", {"loss_agg": "seq_mean_token_mean", "kl_coef": 0.1, "entropy_coef": 0.01}),
    ("dapo", {"loss_agg": "token_mean", "tis_cap": 2.0}),
]


def algo_config(name: str, extra: dict, packed: bool, hf_dir: str = "x", layout: dict | None = None):
    from mtrain.config import load_config, resolve_presets
    overrides = [f"model.hf_path={hf_dir}", "model.dtype=float32", "train.micro_batch_size=2",
                 "optim.use_distributed_optimizer=false",
                 *[f"parallel.{k}={v}" for k, v in (layout or {}).items()]]
    cfg = copy.deepcopy(load_config(CONFIG, overrides))
    # the test's samples are far shorter than the config's rollout limits, which the load-time check covers
    cfg.train.max_tokens_per_micro_batch = BUDGET if packed else None
    cfg.algo = type(cfg.algo)(name=name, **extra)
    resolve_presets(cfg)
    return cfg


def loss_inputs(batch, seed: int = 1):
    """old / reference logprobs (perturbed around the model's own), advantages, and the global normalisers."""
    g = torch.Generator().manual_seed(seed)
    shape = batch.response_mask.shape
    base = -torch.rand(shape, generator=g)
    old = base + 0.05 * torch.randn(shape, generator=g)
    ref = base + 0.05 * torch.randn(shape, generator=g)
    adv = torch.randn(shape, generator=g) * batch.response_mask
    norms = {"num_tokens": float(batch.response_mask.sum()), "num_seqs": float(batch.size)}
    return old, ref, adv, norms


def hf_reference(hf_dir: str) -> dict:
    """transformers in float64: logprobs of every real position, and for each algorithm the global loss and
    the gradient of every HF parameter (policy_loss on the whole batch: the sum every layout must reproduce)."""
    from transformers import AutoModelForCausalLM

    from mtrain.algorithms.objective import policy_loss
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float64, attn_implementation="eager",
                                                 experts_implementation="eager")  # grouped_mm: no float64
    model.train()
    batch = make_batch(json.loads((Path(hf_dir) / "config.json").read_text())["vocab_size"])
    old, ref, adv, norms = loss_inputs(batch)
    width = batch.tokens.shape[1] - 1
    out = {"algos": []}
    for i, (name, extra) in enumerate(ALGOS):
        cfg = algo_config(name, extra, packed=False, hf_dir=hf_dir)
        model.zero_grad(set_to_none=True)
        lps, ents = [], []
        for r in range(batch.size):
            n = int(batch.seq_lens[r])
            ids = batch.tokens[r, :n].unsqueeze(0)
            logits = model(ids).logits[0, :-1] / max(cfg.rollout.temperature, 1e-6)
            logp = torch.log_softmax(logits, -1)
            lps.append(torch.nn.functional.pad(logp.gather(-1, ids[0, 1:, None])[:, 0], (0, width - (n - 1))))
            ents.append(torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (0, width - (n - 1))))
        lp, ent = torch.stack(lps), torch.stack(ents)
        mask = batch.response_mask.double()
        loss, _ = policy_loss(cfg.algo, lp, old.double(), adv.double(), mask, ref_logprobs=ref.double(),
                              entropy=ent, rollout_logprobs=batch.engine_logprobs.double(),
                              norm_len=cfg.rollout.max_new_tokens, **norms)
        loss.backward()
        if i == 0:
            out["lp"] = lp.detach().float()
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        out["algos"].append({"loss": float(loss.detach()), "grads": checkpoint_names(grads)})
    return out


def checkpoint_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 holds a MoE layer's experts fused ([E, 2I, H] gate_up_proj = gate rows then up rows,
    [E, H, I] down_proj); the checkpoint (and so the resharding plan) names one tensor per expert."""
    out = {}
    for k, g in grads.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            half = g.shape[1] // 2
            for e in range(g.shape[0]):
                out[f"{k[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = g[e, :half]
                out[f"{k[:-len('gate_up_proj')]}{e}.up_proj.weight"] = g[e, half:]
        elif k.endswith(".mlp.experts.down_proj"):
            for e in range(g.shape[0]):
                out[f"{k[:-len('down_proj')]}{e}.down_proj.weight"] = g[e]
        else:
            out[k] = g
    return out


def run(rank: int, world: int, hf_dir: str, layout: dict, modes: tuple[bool, ...]) -> dict:
    """One Actor on this rank; for each mode (packed or not): logprobs of the whole batch, then for each algorithm
    one forward/backward. Returns per mode the loss (summed over micro-batches and DP ranks) and this rank's DDP
    main_grads under Megatron names."""
    from megatron.core import parallel_state as ps

    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.trainer.learner.actor import Actor
    from mtrain.trainer.engines import weight_loader

    init_distributed(**layout)
    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    cfg0 = algo_config(*ALGOS[0], packed=modes[0], hf_dir=hf_dir, layout=layout)
    actor = Actor(cfg0, hf_config, load_weights=weight_loader(cfg0, model_layout(hf_config), rank))
    batch = make_batch(hf_config["vocab_size"])
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    # finalize_model_grads updates DeepSeek-V3's router expert_bias from the tokens each expert saw: every pass
    # starts from the loaded buffers, as transformers does
    buffers = [(b, b.detach().clone()) for c in actor.chunks for _, b in c.named_buffers()]
    return {packed: _one_mode(actor, rank, hf_dir, layout, batch, packed, last, buffers) for packed in modes}


def _one_mode(actor, rank: int, hf_dir: str, layout: dict, batch, packed: bool, last: bool, buffers) -> dict:
    from megatron.core import parallel_state as ps

    from mtrain.reshard.megatron_side import chunk_tensors, current_layout
    from mtrain.trainer.batch import dp_rows
    old, ref, adv, norms = loss_inputs(batch)
    actor.cfg = algo_config(*ALGOS[0], packed=packed, hf_dir=hf_dir, layout=layout)
    sl = dp_rows(batch.seq_lens, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), by_tokens=packed)
    mine = batch.select(sl)
    result: dict = {"last": last, "layout": vars(current_layout()), "algos": []}
    for b, saved in buffers:
        b.copy_(saved)
    lp = actor.logprobs(mine)
    if last:
        full = torch.zeros(batch.response_mask.shape)
        full[sl] = lp
        torch.distributed.all_reduce(full, group=ps.get_data_parallel_group())
        result["lp"] = full.numpy()
    for name, extra in ALGOS:
        actor.cfg = algo_config(name, extra, packed=packed, hf_dir=hf_dir, layout=layout)
        for b, saved in buffers:
            b.copy_(saved)
        outs = actor.forward_backward(mine, old[sl], adv[sl], ref[sl], norms)
        loss = torch.tensor(sum(float(o["loss/total"]) for o in outs))
        if last:
            torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
        grads = {}
        for ci, tensors in enumerate(chunk_tensors(actor.chunks)):
            for n, p in tensors.items():
                g = getattr(p, "main_grad", None)
                grads[(rank, ci, n)] = (g if g is not None else torch.zeros_like(p)).detach().float().clone().numpy()
        result["algos"].append({"loss": float(loss) if last else None, "grads": grads})
    return result


def full_grads(hf_dir: str, per_rank: list[dict], algo: int) -> dict[str, torch.Tensor]:
    """Every rank's Megatron gradient shards of one algorithm, gathered into full HF-named tensors by the
    resharding planner (the same Megatron -> HF plan the converters and the weight sync use)."""
    from mtrain.layouts import model_layout
    from mtrain.reshard.local import reshard_in_memory
    from mtrain.reshard.placement import HFLayout, MegatronLayout
    from mtrain.reshard.planner import build_plan
    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    src = MegatronLayout(**per_rank[0]["layout"])
    shards = {k: torch.from_numpy(v) for res in per_rank for k, v in res["algos"][algo]["grads"].items()}
    got = reshard_in_memory(build_plan(model_layout(hf_config), src, HFLayout()), shards, dtype=torch.float32,
                            backend="torch")
    return {name: v for (_, _, name), v in got.items()}
