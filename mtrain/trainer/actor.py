"""The policy on Megatron-core: model chunks, optimizer, per-token logprobs, and one PPO-style update.

Every forward goes through Megatron's own pipeline schedule (`get_forward_backward_func`), so TP, PP and
VPP work the same for scoring and for training. Logprobs are taken from the vocab-parallel logits with the
padded vocabulary columns masked out (they are zero rows in Megatron's embedding but do not exist in HF or
SGLang, so leaving them in would shift every logprob).
"""
from __future__ import annotations

from functools import partial

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from mtrain.algorithms.objective import policy_loss
from mtrain.models import build_model
from mtrain.models.builder import pipeline_split_overrides
from mtrain.models.hf_config import ModelConfigError
from mtrain.trainer.batch import RolloutBatch
from mtrain.trainer.memory_stats import memory_metrics
from mtrain.trainer.train_options import cpu_offload_options, recompute_overrides


def _masked_vocab_logits(logits: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    logits = logits.float() / max(temperature, 1e-6)
    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    if start + local > vocab:  # this TP rank holds padding columns
        pad = torch.arange(start, start + local, device=logits.device) >= vocab
        logits = logits.masked_fill(pad, float("-inf"))
    return logits


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    """[b, s-1] logprob of tokens[:, 1:] under softmax(logits[:, :-1] / T), TP-vocab-parallel."""
    lg = _masked_vocab_logits(logits[:, :-1], vocab, temperature)
    return -tensor_parallel.vocab_parallel_cross_entropy(lg.contiguous(), tokens[:, 1:].contiguous())


def vocab_parallel_entropy(logits: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    lg = _masked_vocab_logits(logits[:, :-1], vocab, temperature)
    m = lg.detach().max(dim=-1, keepdim=True).values
    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    e = torch.exp(lg - m)
    s = tensor_parallel.reduce_from_tensor_model_parallel_region(e.sum(-1))
    pl = tensor_parallel.reduce_from_tensor_model_parallel_region((e * torch.nan_to_num(lg, neginf=0.0)).sum(-1))
    return torch.log(s) + m.squeeze(-1) - pl / s


class Actor:
    def __init__(self, cfg, hf_config: dict, load_weights=None, trainable: bool = True):
        """load_weights(chunks) fills the unwrapped model before the optimizer copies its main params.
        trainable=False: a frozen scorer (the KL reference policy), no DDP, no optimizer."""
        self.cfg, self.hf_config = cfg, hf_config
        self.dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        par = cfg.parallel
        if not cfg.model.mtp:  # RL trains the main model: the MTP layers stay in the converted checkpoint
            hf_config = dict(hf_config, num_nextn_predict_layers=0)
        overrides = {**pipeline_split_overrides(par.first_stage_layers, par.last_stage_layers),
                     **recompute_overrides(cfg.train.recompute)}
        chunks, self.tconfig = build_model(hf_config, params_dtype=self.dtype, vpp=par.vpp, config_overrides=overrides)
        c = self.tconfig
        if trainable and c.num_moe_experts and c.tensor_model_parallel_size > 1 and not c.sequence_parallel:
            # megatron-core refuses MoE + TP training without sequence parallelism, which its local (non-TE)
            # norms do not support: say so before the first rollout, not deep inside the first backward.
            raise ModelConfigError(f"parallel.tp={c.tensor_model_parallel_size} with a MoE model trains only with sequence "
                             f"parallelism, which needs Transformer Engine (not importable here): use parallel.tp=1 "
                             f"with parallel.ep for the experts")
        if load_weights is not None:
            load_weights(chunks)
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
        if self.dtype == torch.bfloat16:
            from megatron.core.transformer.module import Float16Module
            chunks = [Float16Module(self.tconfig, c) for c in chunks]
        self.vocab = hf_config["vocab_size"]
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if not trainable:
            self.chunks = chunks
            for c in chunks:
                c.requires_grad_(False)
            return
        self.chunks = [DistributedDataParallel(self.tconfig, ddp_cfg, c) for c in chunks]
        # Megatron's schedule calls this after the last backward: DP gradient reduction (DDP.finish_grad_sync),
        # the first/last-stage all-reduce of tied embedding grads, TP all-reduce of sequence-parallel norm grads.
        # Without it every DP rank would step with its own local gradient.
        from megatron.core.distributed import finalize_model_grads
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        o = cfg.optim
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.eps, clip_grad=o.clip_grad,
            bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
            use_distributed_optimizer=o.use_distributed_optimizer, **cpu_offload_options(o.cpu_offload)), self.chunks)
        steps = max(cfg.train.steps, 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps, lr_decay_steps=max(steps, o.warmup_steps + 1),
            lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=steps, wd_incr_style="constant",
            # On resume the schedule's shape comes from this run's config (a relaunch with more train.steps
            # extends the decay); only the position (num_steps) comes from the checkpoint.
            use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)

    # ---------------------------------------------------------------- forward plumbing
    def _run(self, micro: list[dict], loss_fn, forward_only: bool) -> list:
        def step(data_iter, model):
            mb = next(data_iter)
            pos = torch.arange(mb["tokens"].shape[1], device=mb["tokens"].device).unsqueeze(0).expand_as(mb["tokens"])
            out = model(mb["tokens"], pos, None)
            return out, partial(loss_fn, mb)

        model = self.chunks if len(self.chunks) > 1 else self.chunks[0]
        iters = [iter(micro) for _ in self.chunks] if len(self.chunks) > 1 else iter(micro)
        t, b = micro[0]["tokens"].shape[1], micro[0]["tokens"].shape[0]
        return get_forward_backward_func()(forward_step_func=step, data_iterator=iters, model=model,
                                           num_microbatches=len(micro), seq_length=t, micro_batch_size=b,
                                           forward_only=forward_only)

    def _micro(self, batch: RolloutBatch, extra: dict[str, torch.Tensor]) -> list[dict]:
        mbs = self.cfg.train.micro_batch_size
        if batch.size % mbs:
            raise ValueError(f"{batch.size} samples per data-parallel rank do not split into micro batches of "
                             f"{mbs} (train.micro_batch_size)")
        dev = self.device
        out = []
        for s in range(0, batch.size, mbs):
            d = {"tokens": batch.tokens[s:s + mbs], "mask": batch.response_mask[s:s + mbs]}
            d.update({k: v[s:s + mbs] for k, v in extra.items()})
            out.append({k: v.to(dev) for k, v in d.items()})
        return out

    def logprobs(self, batch: RolloutBatch) -> torch.Tensor | None:
        """[B, T-1] logprobs on the last pipeline stage (None elsewhere), no grad."""
        temp = self.cfg.rollout.temperature

        def loss_fn(mb, logits):
            lp = token_logprobs(logits, mb["tokens"], self.vocab, temp)
            return torch.zeros((), device=lp.device), {"lp": lp.detach()}

        for c in self.chunks:
            c.eval()
        with torch.no_grad():
            outs = self._run(self._micro(batch, {}), loss_fn, forward_only=True)
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            return None
        return torch.cat([o["lp"] for o in outs]).float().cpu()

    def train_step(self, batch: RolloutBatch, old_lp, adv, ref_lp, norms: dict) -> dict[str, float]:
        """One optimizer step over `batch` (this DP rank's share). norms: global num_tokens / num_seqs."""
        algo, temp = self.cfg.algo, self.cfg.rollout.temperature
        dp = ps.get_data_parallel_world_size()
        # old/ref logprobs exist on the last pipeline stage only, which is also the only one computing a loss.
        extra = {k: v for k, v in {"old": old_lp, "adv": adv, "engine": batch.engine_logprobs, "ref": ref_lp}.items()
                 if v is not None}
        micro = self._micro(batch, extra)

        def loss_fn(mb, logits):
            lp = token_logprobs(logits, mb["tokens"], self.vocab, temp)
            ent = vocab_parallel_entropy(logits, self.vocab, temp) if algo.entropy_coef else None
            loss, metrics = policy_loss(algo, lp, mb["old"], mb["adv"], mb["mask"], ref_logprobs=mb.get("ref"),
                                        entropy=ent, rollout_logprobs=mb["engine"],
                                        norm_len=self.cfg.rollout.max_new_tokens, **norms)
            # Megatron divides by the number of micro batches and DDP averages over DP: undo both, the
            # normalisers already cover the whole global batch.
            return loss * len(micro) * dp, {k: v.detach().float() for k, v in metrics.items()}

        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        outs = self._run(micro, loss_fn, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        metrics = {}
        if outs:
            for k in outs[0]:
                metrics[k] = float(torch.stack([o[k] for o in outs]).mean())
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["update_skipped"] = float(not ok)
        metrics.update(memory_metrics(self, ps.get_pipeline_model_parallel_rank()))  # after the step: Adam state exists
        return metrics
