"""Rank body for tests/trainer/test_packing_numerics.py: one Actor, the same rollout batch scored and trained
padded and packed, and transformers' own forward as the independent reference (a module-level function, so
mtrain.dist.run_on_ranks can spawn it)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
# Heavy-tailed RL-like lengths: many short samples, a few long ones (prompt, response).
SHAPES = [(3, 2), (5, 9), (2, 1), (4, 30), (6, 3), (3, 14), (2, 5), (5, 2)]
BUDGET = 40
ALGOS = [  # (algo.name, extra settings): every loss aggregation, both policy losses, KL, entropy, TIS
    ("grpo", {"loss_agg": "seq_mean_token_mean", "kl_coef": 0.1, "entropy_coef": 0.01}),
    ("dapo", {"loss_agg": "token_mean", "tis_cap": 2.0}),
    ("dr_grpo", {"loss_agg": "seq_mean_token_sum_norm"}),
    ("grpo", {"loss_agg": "seq_mean_token_sum", "dual_clip_c": 3.0}),
    ("gspo", {"loss_agg": "seq_mean_token_mean"}),
]


def make_batch(vocab: int, seed: int = 0):
    from mtrain.rollout.protocol import Completion
    from mtrain.trainer.batch import build_batch
    g = torch.Generator().manual_seed(seed)
    comps = []
    for i, (p, r) in enumerate(SHAPES):
        ids = torch.randint(3, vocab, (p + r,), generator=g).tolist()
        comps.append(Completion(rid=str(i), prompt_ids=ids[:p], output_ids=ids[p:],
                                logprobs=(-torch.rand(r, generator=g)).tolist(), finish_reason="length",
                                weight_version=0))
    rewards = torch.rand(len(SHAPES), generator=g).tolist()
    return build_batch(comps, rewards, pad_id=0)


def hf_logprobs(hf_dir: str, batch) -> torch.Tensor:
    """[B, T-1] logprobs of every real token from transformers, one unpadded sequence at a time (float64 softmax)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
    out = torch.zeros(batch.response_mask.shape)
    with torch.no_grad():
        for i in range(batch.size):
            n = int(batch.seq_lens[i])
            ids = batch.tokens[i, :n].unsqueeze(0)
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            out[i, :n - 1] = logp.gather(-1, ids[0, 1:, None])[:, 0].float()
    return out


def _valid(batch) -> torch.Tensor:
    w = batch.tokens.shape[1] - 1
    return torch.arange(w)[None, :] < (batch.seq_lens[:, None] - 1)


def _grads(actor) -> dict[str, torch.Tensor]:
    out = {}
    for i, c in enumerate(actor.chunks):
        for name, p in c.named_parameters():
            g = getattr(p, "main_grad", None)
            out[f"{i}.{name}"] = (g if g is not None else torch.zeros_like(p)).detach().float().cpu().clone()
    return out


def run(rank: int, world: int, hf_dir: str, layout: dict, ref: torch.Tensor, return_grads: bool = False) -> dict:
    """ref: hf_logprobs(hf_dir, make_batch(vocab)), computed by the caller in a process without Megatron's CPU
    shim (transformers' from_pretrained under the shim leaves RoPE's inv_freq buffer uninitialised)."""
    from megatron.core import parallel_state as ps

    from mtrain.config import load_config
    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.trainer.learner.actor import Actor
    from mtrain.trainer.batch import dp_rows
    from mtrain.trainer.engines import weight_loader

    init_distributed(**layout)
    overrides = [f"model.hf_path={hf_dir}", "model.dtype=float32", "train.micro_batch_size=2",
                 "optim.use_distributed_optimizer=false",
                 *[f"parallel.{k}={v}" for k, v in layout.items()],
                 *([f"train.max_tokens_per_micro_batch={BUDGET}"] if layout.get("cp", 1) > 1 else [])]
    cfg = load_config(CONFIG, overrides)
    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    packed_cfg = copy.deepcopy(cfg)
    packed_cfg.train.max_tokens_per_micro_batch = BUDGET
    actor = Actor(packed_cfg if layout.get("cp", 1) > 1 else cfg, hf_config,
                  load_weights=weight_loader(cfg, model_layout(hf_config), rank))
    batch = make_batch(hf_config["vocab_size"])
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    def rows(packed: bool):
        sl = dp_rows(batch.seq_lens, dp_rank, dp_size, by_tokens=packed)
        return batch.select(sl), sl

    # context parallelism exists for packed micro-batches only: there the caller compares with a TP1 run
    modes = (True,) if layout.get("cp", 1) > 1 else (False, True)
    result: dict = {"last": last}
    # ---- logprobs: padded vs packed vs transformers (every real position, not only the response)
    lps = {}
    for packed in modes:
        actor.cfg = packed_cfg if packed else cfg
        mine, sl = rows(packed)
        lp = actor.logprobs(mine)
        if lp is not None:
            full = torch.zeros(batch.response_mask.shape)
            full[sl] = lp
            lps[packed] = full
    if last:
        # gather every DP rank's rows (each rank scored its own share) into the whole batch
        for k in lps:
            torch.distributed.all_reduce(lps[k], group=ps.get_data_parallel_group())
        valid = _valid(batch)
        result["lp_packed_vs_hf"] = float((lps[True] - ref).abs()[valid].max())
        if False in lps:
            result["lp_packed_vs_padded"] = float((lps[True] - lps[False]).abs()[valid].max())
            result["lp_padded_vs_hf"] = float((lps[False] - ref).abs()[valid].max())
    # ---- loss and gradients, every algorithm: padded vs packed (old/ref: perturbed copies of the HF logprobs)
    g = torch.Generator().manual_seed(1)
    base = ref
    old = base + 0.05 * torch.randn(base.shape, generator=g)
    refl = base + 0.05 * torch.randn(base.shape, generator=g)
    adv = torch.randn(base.shape, generator=g) * batch.response_mask
    norms = {"num_tokens": float(batch.response_mask.sum()), "num_seqs": float(batch.size)}
    from mtrain.config import resolve_presets
    result["algos"] = []
    # finalize_model_grads updates DeepSeek-V3's router expert_bias from the tokens each expert saw: put every
    # buffer back before each pass so that both passes start from the same model.
    buffers = [(b, b.detach().clone()) for c in actor.chunks for _, b in c.named_buffers()]
    for name, extra in ALGOS:
        out = {}
        for packed in modes:
            c = copy.deepcopy(packed_cfg if packed else cfg)
            c.algo = type(c.algo)(name=name, **extra)
            resolve_presets(c)
            actor.cfg = c
            mine, sl = rows(packed)
            for b, saved in buffers:
                b.copy_(saved)
            outs = actor.forward_backward(mine, old[sl], adv[sl], refl[sl] if c.algo.kl_coef else None, norms)
            loss = torch.tensor(sum(float(o["loss/total"]) for o in outs))
            if last:  # sum over every micro-batch of every data-parallel rank
                torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
            out[packed] = (float(loss), _grads(actor))
        entry = {"algo": f"{name}/{extra['loss_agg']}", "loss_packed": out[True][0],
                 "grad_max_abs": max(float(v.abs().max()) for v in out[True][1].values())}
        if False in out:
            entry["loss_padded"] = out[False][0]
            entry["grad_max_abs_diff"] = max(float((out[True][1][k] - out[False][1][k]).abs().max())
                                             for k in out[False][1])
        if return_grads:
            entry["grads_packed"] = {k: v.numpy() for k, v in out[True][1].items()}  # tensors would go by fd
        result["algos"].append(entry)
    return result
