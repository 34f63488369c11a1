"""PPO's value model on Megatron-core: the policy's architecture with a scalar head in place of the LM head.

The critic is an `Actor` (the same build, layout, pipeline schedule, packing and micro-batching) whose chunks get,
right after their weights are loaded and before DDP wraps them, a `ValueHead` as GPTModel's `output_layer`: the
model's forward then returns [b, s, 1] values instead of logits (GPTModel calls `output_layer(hidden, weight=...,
runtime_gather_output=...)`; the head ignores the tied weight). Nothing in megatron-core is patched.

The head's weight is replicated on every TP rank (width 1 does not split); every TP rank sees the whole hidden
state (gathered first under sequence parallelism, with a backward that splits instead of summing) and computes
the same loss, so the replicas receive equal gradients and stay equal without a reduction. Its initial value
comes from a fixed generator, equal on every rank. Tied input/output embeddings are untied on the critic (the LM
head is gone), so Megatron's first/last-stage embedding all-reduce does not apply to it.

The value of a response token is read at the position that predicts it (the state before the token), aligned
with the response mask [B, T-1] like the policy's logprobs.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from mtrain.algorithms.value_loss import clipped_value_loss
from mtrain.trainer.learner.actor import Actor
from mtrain.trainer.batch import RolloutBatch

HEAD_SEED = 20_16  # the head's initial weight: the same on every rank and every run


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype):
        super().__init__()
        g = torch.Generator().manual_seed(HEAD_SEED)
        # OpenRLHF's value-head init: normal with std 1 / (hidden + 1); the bias starts at 0
        w = torch.randn(1, hidden_size, generator=g, dtype=torch.float64) / (hidden_size + 1)
        self.weight = torch.nn.Parameter(w.to(dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel  # GPTModel reads this attribute of its output layer

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return F.linear(hidden, self.weight.to(hidden.dtype), self.bias.to(hidden.dtype)), None


def critic_config(cfg):
    """The run config the critic is built from: critic.hf_path's weights (default: the policy's), the critic's
    learning rate, its own routing (the engine's expert choices belong to the policy), the default kernels (bitwise
    on-policy is the policy's), all of its weights trained
    (model.lora adapts the policy only: a new value head on a frozen base would learn little)."""
    c = cfg.critic
    model = cfg.model if c.hf_path is None else dataclasses.replace(cfg.model, hf_path=c.hf_path, mcore_ckpt=None)
    model = dataclasses.replace(model, lora=type(cfg.model.lora)())
    optim = dataclasses.replace(cfg.optim, lr=c.lr, min_lr=min(cfg.optim.min_lr, c.lr))
    algo = dataclasses.replace(cfg.algo, routing_replay="off")
    # numerics.on_policy=bitwise concerns the policy's logprobs: values need no agreement with the engine
    numerics = dataclasses.replace(cfg.numerics, on_policy="off")
    return dataclasses.replace(cfg, model=model, optim=optim, algo=algo, numerics=numerics)


def attach_value_heads(chunks, tconfig) -> None:
    """Replace the LM head of the last-stage chunk(s) by a ValueHead (in place, before DDP wraps them)."""
    for c in chunks:
        c.share_embeddings_and_output_weights = False
        if getattr(c, "post_process", False):
            device = c.output_layer.weight.device if c.output_layer.weight is not None else \
                next(c.parameters()).device  # the model's device (a GPU under CUDA)
            c.output_layer = ValueHead(tconfig.hidden_size, tconfig.sequence_parallel,
                                       tconfig.params_dtype).to(device)


class Critic(Actor):
    def __init__(self, cfg, hf_config: dict, load_weights, overrides: dict | None = None):
        """load_weights fills the critic's chunks (LM head included) from critic.hf_path or the policy's weights;
        the head is swapped right after, before DDP and the optimizer see the parameters."""
        def load(chunks) -> None:
            load_weights(chunks)
            attach_value_heads(chunks, self.tconfig)  # Actor sets self.tconfig before it loads

        super().__init__(critic_config(cfg), hf_config, load_weights=load, overrides=overrides)
        self.run_cfg = cfg

    def _values(self, mb: dict, out: torch.Tensor) -> torch.Tensor:
        """[b, s, 1] head output -> values per predicting position in the row layout of mb["mask"]."""
        return self._rows(mb, out[..., 0].float()[:, :-1])

    def values(self, batch: RolloutBatch) -> torch.Tensor | None:
        """[B, T-1] values of `batch` on the last pipeline stage (None elsewhere), no grad."""

        def loss_fn(mb, out):
            v = self._values(mb, out)
            return torch.zeros((), device=v.device), {"v": v.detach()}

        for c in self.chunks:
            c.eval()
        micro = self._micro(batch, {})
        with torch.no_grad():
            outs = self._run(micro, loss_fn, forward_only=True)
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            return None
        vals = torch.zeros(batch.response_mask.shape, dtype=torch.float64)
        for mb, o in zip(micro, outs):
            vals[mb["rows"]] = o["v"].double().cpu()
        return vals

    def train_step(self, batch: RolloutBatch, old_values, returns, norms: dict) -> dict[str, float]:
        """One optimizer step of the clipped value loss over `batch` (this DP rank's share)."""
        c, dp = self.run_cfg.critic, ps.get_data_parallel_world_size()
        extra = {k: v for k, v in {"old_v": old_values, "ret": returns}.items() if v is not None}
        micro = self._micro(batch, extra)

        def loss_fn(mb, out):
            v = self._values(mb, out)
            loss, m = clipped_value_loss(v, mb["old_v"].float(), mb["ret"].float(), mb["mask"].bool(),
                                         cliprange_value=c.value_clip, loss_agg="token_mean",
                                         num_tokens=norms["num_tokens"])
            return loss * len(micro) * dp, {k: x.detach().float() for k, x in m.items()}

        for ch in self.chunks:
            ch.train()
            ch.zero_grad_buffer()
        self.optimizer.zero_grad()
        outs = self._run(micro, loss_fn, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        metrics = {}
        if outs:  # each micro-batch's loss is its share of the minibatch's (global token count): their sum is this
            # DP rank's share; x dp, so that the loop's mean over ranks is the minibatch's whole loss
            metrics["critic/value_loss"] = float(sum(o["critic/value_loss"] for o in outs)) * dp
            metrics["critic/vpred_mean"] = float(torch.stack([o["critic/vpred_mean"] for o in outs]).mean())
            # the share of tokens whose value the clip held back (value_loss.py calls it critic/clipfrac)
            metrics["critic/vf_clipfrac"] = float(torch.stack([o["critic/clipfrac"] for o in outs]).mean())
        metrics["critic/grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        metrics["critic/lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["critic/update_skipped"] = float(not ok)
        return metrics

