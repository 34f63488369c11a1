"""The policy on Megatron-core: model chunks, optimizer, per-token logprobs, and one PPO-style update.

Every forward goes through Megatron's own pipeline schedule (`get_forward_backward_func`), so TP, PP and
VPP work the same for scoring and for training. Logprobs are taken from the vocab-parallel logits with the
padded vocabulary columns masked out (they are zero rows in Megatron's embedding but do not exist in HF or
SGLang, so leaving them in would shift every logprob).
"""
from __future__ import annotations

import os
from functools import partial

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from mtrain.algorithms.objective import policy_loss
from mtrain.compat.no_te import te_installed
from mtrain.models.cp_comm import gather_cp
from mtrain.models import build_model, packed_rope
from mtrain.lora_checks import check_model as lora_check_model
from mtrain.models.lora import attach_lora, spec_of as lora_spec_of
from mtrain.models.builder import pipeline_split_overrides
from mtrain.models.fp32_head import install_fp32_lm_head
from mtrain.models.token_logprobs import token_logprobs as chunked_token_logprobs
from mtrain.models.hf_config import ModelConfigError, map_hf_config
from mtrain.layouts.vlm import MEGATRON_VISION
from mtrain.trainer.batch import RolloutBatch
from mtrain.trainer.prefix_tree import make_tree_pack, plan_shared_micro_batches, shared_rows
from mtrain.trainer.packing import make_pack, pack, padded_cp_inputs, plan_micro_batches, unpack, unpack_index
from mtrain.rollout.routing import RoutingError, routing_shape
from mtrain.trainer.memory_stats import memory_metrics
from mtrain.trainer.weight_change import WeightChange
from mtrain.trainer.learner.routing_replay import RouterReplayFeeder
from mtrain.trainer.train_options import cpu_offload_options, optimizer_config, recompute_overrides


def _masked_vocab_logits(logits: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    logits = logits.float() / max(temperature, 1e-6)
    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    if start + local > vocab:  # this TP rank holds padding columns
        pad = torch.arange(start, start + local, device=logits.device) >= vocab
        logits = logits.masked_fill(pad, float("-inf"))
    return logits


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab: int, temperature: float,
                   bitwise: bool = False) -> torch.Tensor:
    """[b, s-1] logprob of tokens[:, 1:] under softmax(logits[:, :-1] / T), TP-vocab-parallel."""
    return _chunked_logprobs(logits[:, :-1], tokens[:, 1:], vocab, temperature, bitwise)


def _chunked_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab: int, temperature: float,
                      bitwise: bool = False) -> torch.Tensor:
    """No float32 copy of the whole logits (mtrain/models/token_logprobs.py: a 16k-token micro-batch's was 10 GB)."""
    return chunked_token_logprobs(logits, labels, vocab, temperature, ps.get_tensor_model_parallel_rank()
                                  * logits.shape[-1], ps.get_tensor_model_parallel_group(), bitwise=bitwise)


def head_logprobs(logits: torch.Tensor, ids: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    """[b, s, K] log softmax(logits / T) at token ids [b, s, K] (score centering's head), TP-vocab-parallel: each
    rank gathers the ids in its vocabulary slice, the log-normaliser and the gathered values are summed over TP."""
    lg = _masked_vocab_logits(logits, vocab, temperature)
    m = lg.detach().max(dim=-1, keepdim=True).values
    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    lse = torch.log(tensor_parallel.reduce_from_tensor_model_parallel_region(torch.exp(lg - m).sum(-1))) + m.squeeze(-1)
    local = lg.shape[-1]
    shifted = ids - ps.get_tensor_model_parallel_rank() * local
    mine = (shifted >= 0) & (shifted < local)
    picked = torch.where(mine, lg.gather(-1, shifted.clamp(0, local - 1)), lg.new_zeros(()))
    return tensor_parallel.reduce_from_tensor_model_parallel_region(picked) - lse.unsqueeze(-1)


def vocab_parallel_entropy(logits: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    """[b, s-1] entropy of softmax(logits[:, :-1] / T), TP-vocab-parallel."""
    return position_entropy(logits[:, :-1], vocab, temperature)


def position_entropy(logits: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    """[b, s] entropy at every position."""
    lg = _masked_vocab_logits(logits, vocab, temperature)
    m = lg.detach().max(dim=-1, keepdim=True).values
    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    e = torch.exp(lg - m)
    s = tensor_parallel.reduce_from_tensor_model_parallel_region(e.sum(-1))
    pl = tensor_parallel.reduce_from_tensor_model_parallel_region((e * torch.nan_to_num(lg, neginf=0.0)).sum(-1))
    return torch.log(s) + m.squeeze(-1) - pl / s


class Actor:
    def __init__(self, cfg, hf_config: dict, load_weights=None, trainable: bool = True, overrides: dict | None = None):
        """load_weights(chunks) fills the unwrapped model before the optimizer copies its main params.
        trainable=False: a frozen scorer (the KL reference policy), no DDP, no optimizer.
        overrides: TransformerConfig fields decided for the run (`mtrain.trainer.decisions`), e.g. sequence_parallel."""
        self.cfg, self.hf_config = cfg, hf_config
        self.dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        par = cfg.parallel
        if not cfg.model.mtp:  # RL trains the main model: the MTP layers stay in the converted checkpoint
            hf_config = dict(hf_config, num_nextn_predict_layers=0)
        split = {**pipeline_split_overrides(par.first_stage_layers, par.last_stage_layers),
                 **recompute_overrides(cfg.train.recompute)}
        self.vision = None  # a vision-language model: MRoPE positions and images per micro-batch
        if map_hf_config(hf_config).vision:
            from mtrain.trainer.vision_inputs import VisionBatcher
            if par.cp > 1:
                raise ModelConfigError(f"parallel.cp={par.cp}: context parallelism is not supported for "
                                       "vision-language models yet (MRoPE positions per packed token)")
            self.vision = VisionBatcher(hf_config)
        elif cfg.model.train_vision:
            raise ModelConfigError(f"model.train_vision=true but {hf_config.get('model_type')} has no vision tower")
        # algo.routing_replay (mtrain/trainer/learner/routing_replay.py): rollout = every MoE router replays the engine's
        # experts, which the batch carries (self.routing: their shape); trainer = the update replays the scoring
        # pass's own choice (the frozen reference model has no update: it routes itself)
        mode = cfg.algo.routing_replay
        shape = routing_shape(hf_config) if mode != "off" else None
        if mode != "off" and shape is None:
            raise ModelConfigError(f"algo.routing_replay={mode} needs a MoE model; {hf_config.get('model_type')!r} "
                                   f"has no routed experts (use algo.routing_replay=off)")
        self.routing = shape if mode == "rollout" else None
        replays = mode == "rollout" or (mode == "trainer" and trainable)
        if replays:
            split["moe_enable_routing_replay"] = True
        lora_check_model(cfg, hf_config)
        # numerics.on_policy=bitwise is the policy's: its update must see the engine's logprobs bit for bit. A frozen
        # scorer (the KL reference, a teacher) only meets the policy inside a loss term, so it keeps the default
        # kernels and their speed (docs/design-on-policy.md, "The scoring pass")
        self.bitwise = trainable and cfg.numerics.on_policy == "bitwise"
        chunks, self.tconfig = build_model(hf_config, params_dtype=self.dtype, vpp=par.vpp,
                                           config_overrides={**split, **(overrides or {})},
                                           train_vision=cfg.model.train_vision,
                                           on_policy="bitwise" if self.bitwise else "off")
        c = self.tconfig
        # Packed streams: megatron-core gets cu_seqlens on the host when mtrain's local core attention serves it
        # (no device sync in its THD RoPE, Pack.packed_seq_params); TE's attention and MTP read it on the device.
        self.host_cu_seqlens = not te_installed() and not c.mtp_num_layers
        # ... and, with one CP rank and plain RoPE or YaRN, one rotary row per token instead of megatron-core's split /
        # slice / cat per sequence in every layer (mtrain/models/packed_rope.py; the same rotation bit for bit).
        # MTRAIN_ROPE_PER_TOKEN=0: megatron-core's own per-sequence path (for an A/B on a GPU)
        self.rope_per_token = (self.host_cu_seqlens and c.context_parallel_size == 1 and self.vision is None
                               and os.environ.get("MTRAIN_ROPE_PER_TOKEN", "1") != "0"
                               and packed_rope.install(chunks))
        if cfg.train.shared_prefix and not self.rope_per_token:  # the tree stream's positions need per-token RoPE
            raise ModelConfigError("train.shared_prefix needs mtrain's local attention with per-token RoPE (no "
                                   "Transformer Engine, parallel.cp=1, plain RoPE or YaRN, no vision tower)")
        if trainable and c.num_moe_experts and c.tensor_model_parallel_size > 1 and not c.sequence_parallel and \
                not self.bitwise:  # the bitwise MoE layer needs no SP (preflight.py says why)
            # megatron-core refuses MoE + TP training without sequence parallelism, which its local (non-TE)
            # norms do not support: say so before the first rollout, not deep inside the first backward.
            raise ModelConfigError(f"parallel.tp={c.tensor_model_parallel_size} with a MoE model trains only with sequence "
                             f"parallelism, which needs Transformer Engine (not importable here): use parallel.tp=1 "
                             f"with parallel.ep for the experts")
        if load_weights is not None:
            load_weights(chunks)
        if cfg.model.fp32_lm_head:
            install_fp32_lm_head(chunks)
        # model.lora: base frozen, adapters the only trainable parameters (the KL reference keeps the base alone)
        self.lora_spec = spec = lora_spec_of(cfg) if trainable else None
        # with model.train_vision the vision tower and merger train in full beside the adapters (docs/design-lora.md)
        self.lora = attach_lora(chunks, hf_config, spec, cfg.model.lora.dropout, te=te_installed(),
                                also_train=(MEGATRON_VISION,) if cfg.model.train_vision else ()) if spec else None
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
        if self.dtype == torch.bfloat16:
            from megatron.core.transformer.module import Float16Module
            chunks = [Float16Module(self.tconfig, c) for c in chunks]
        self.vocab = map_hf_config(hf_config).vocab_size
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if not trainable:
            self.chunks = chunks
            for c in chunks:
                c.requires_grad_(False)
            self.replay = RouterReplayFeeder(chunks, shape, self.tconfig) if replays else None
            return
        self.chunks = [DistributedDataParallel(self.tconfig, ddp_cfg, c) for c in chunks]
        # keyed by the objects Megatron's schedule hands the forward step: the wrapped chunks
        self.replay = RouterReplayFeeder(self.chunks, shape, self.tconfig, own=mode == "trainer") if replays else None
        # Megatron's schedule calls this after the last backward: DP gradient reduction (DDP.finish_grad_sync),
        # the first/last-stage all-reduce of tied embedding grads, TP all-reduce of sequence-parallel norm grads.
        # Without it every DP rank would step with its own local gradient.
        from megatron.core.distributed import finalize_model_grads
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        o = cfg.optim
        lr = cfg.model.lora.lr if self.lora is not None and cfg.model.lora.lr is not None else o.lr
        opt_cfg = optimizer_config(
            optimizer="adam", lr=lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.eps, clip_grad=o.clip_grad,
            bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
            use_distributed_optimizer=o.use_distributed_optimizer, **cpu_offload_options(o.cpu_offload))
        self.optimizer = get_megatron_optimizer(opt_cfg, self.chunks, config_overrides=vision_lr_overrides(
            opt_cfg, o.lr) if self.lora is not None and cfg.model.train_vision and lr != o.lr else None)
        steps = max(cfg.train.steps, 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if o.warmup_steps else lr, max_lr=lr, min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps, lr_decay_steps=max(steps, o.warmup_steps + 1),
            lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=steps, wd_incr_style="constant",
            # On resume the schedule's shape comes from this run's config (a relaunch with more train.steps
            # extends the decay); only the position (num_steps) comes from the checkpoint.
            use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
        self.weight_change = (WeightChange([p for c in self.chunks for p in c.parameters()], self.optimizer)
                              if cfg.train.log_weight_change else None)
        # Set by the bitwise scorer (learner/scoring.py): the next forward_backward compares its logprobs (the
        # weights that generated the rollout, before the optimizer steps) with the engine's.
        self.probe_engine_gap = False
        self._gap: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # per micro-batch: sum, count, max

    # ---------------------------------------------------------------- forward plumbing
    @property
    def packed(self) -> bool:
        """Token-budget packed micro-batches (train.max_tokens_per_micro_batch set) or padded ones."""
        return self.cfg.train.max_tokens_per_micro_batch is not None

    def _run(self, micro: list[dict], loss_fn, forward_only: bool) -> list:
        def step(data_iter, model):
            mb = next(data_iter)
            if self.replay is not None:
                self.replay.feed(model, mb)
            if "pack" in mb:
                out = model(mb["tokens"], mb["position_ids"], None, packed_seq_params=mb["packed_seq_params"],
                            **mb.get("images", {}))
            else:
                pos = mb.get("position_ids")  # MRoPE [3, b, s] of a VLM; under CP this rank's chunks
                if pos is None:
                    pos = torch.arange(mb["tokens"].shape[1], device=mb["tokens"].device).unsqueeze(0).expand_as(mb["tokens"])
                out = model(mb["tokens"], pos, None, **mb.get("images", {}))
            return out, partial(loss_fn, mb)

        model = self.chunks if len(self.chunks) > 1 else self.chunks[0]
        iters = [iter(micro) for _ in self.chunks] if len(self.chunks) > 1 else iter(micro)
        # the schedule divides the sequence length by CP for the pipeline's activation shapes: give the global one
        t = max(m["tokens"].shape[1] for m in micro) * ps.get_context_parallel_world_size()
        b = micro[0]["tokens"].shape[0]
        # Packed micro-batches differ in length: pipeline stages then exchange each activation's shape first
        # (the interleaved schedule gets equal lengths instead, see _micro).
        saved = self.tconfig.variable_seq_lengths
        self.tconfig.variable_seq_lengths = self.packed and len(self.chunks) == 1
        try:
            return get_forward_backward_func()(forward_step_func=step, data_iterator=iters, model=model,
                                               num_microbatches=len(micro), seq_length=t, micro_batch_size=b,
                                               forward_only=forward_only)
        finally:
            self.tconfig.variable_seq_lengths = saved
            if self.replay is not None:
                self.replay.finish()

    def _micro(self, batch: RolloutBatch, extra: dict[str, torch.Tensor]) -> list[dict]:
        """Micro-batches of `batch` (this DP rank's rows). Each holds the model input and, in the row layout
        [n, T-1], the response mask and every tensor in `extra` (what the loss reads). Packed micro-batches
        also hold their Pack and every RolloutBatch.PER_TOKEN field packed ("packed/<name>", [S, ...])."""
        dev = self.device
        cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        if self.packed:
            vpp = len(self.chunks) > 1  # the interleaved schedule wants a multiple of PP micro-batches
            # The budget is per GPU: with CP a micro-batch's stream holds cp times as many tokens, every sequence
            # padded to a multiple of 2 * cp (planned with that padding, so no rank exceeds the budget).
            n = self.cfg.train.max_tokens_per_micro_batch
            slots = -(-batch.seq_lens // (2 * cp)) * (2 * cp) if cp > 1 else batch.seq_lens
            plan = plan_micro_batches(slots, n * cp, budget_name=f"train.max_tokens_per_micro_batch={n} x parallel.cp="
                                      f"{cp}" if cp > 1 else None,
                                      count_multiple=ps.get_pipeline_model_parallel_world_size() if vpp else 1)
            shared = shared_rows(batch) if self.cfg.train.shared_prefix else None  # mtrain/trainer/prefix_tree.py
            if shared is not None:  # a group's rows in one micro-batch, its prompt once
                plan = plan_shared_micro_batches(*shared, n, count_multiple=ps.get_pipeline_model_parallel_world_size()
                                                 if vpp else 1)
            groups = [torch.tensor(g, dtype=torch.long) for g in plan]
            # With variable lengths the interleaved (VPP) schedule's receives came out mis-sized (gloo: "received
            # data size doesn't match"): pad every packed micro-batch of this call to the longest one instead.
            common = max(int(batch.seq_lens[g].sum()) for g in groups) if vpp else 0
        else:
            mbs = self.cfg.train.micro_batch_size
            if batch.size % mbs:
                raise ValueError(f"{batch.size} samples per data-parallel rank do not split into micro batches of "
                                 f"{mbs} (train.micro_batch_size)")
            groups = [torch.arange(s, s + mbs) for s in range(0, batch.size, mbs)]
        sp = self.tconfig.sequence_parallel
        align = (ps.get_tensor_model_parallel_world_size() if sp else 1) * (2 * cp if cp > 1 else 1)
        routed = self._replay_rows(batch)
        out = []
        for rows in groups:
            d = {"mask": batch.response_mask[rows], **{k: v[rows] for k, v in extra.items()}}
            d = {k: v.to(dev) for k, v in d.items()}
            d["rows"] = rows
            if self.packed:
                pk = make_pack(rows, batch.seq_lens[rows], min_total=common, pad_to_multiple=align,
                               seq_multiple=2 * cp if cp > 1 else 1) if shared is None else make_tree_pack(
                    rows, [shared[0][i] for i in rows], [shared[1][i] for i in rows], align, common)
                width = batch.tokens.shape[1]
                for name in RolloutBatch.PER_TOKEN:
                    if getattr(batch, name) is not None:
                        d[f"packed/{name}"] = pack(pk, getattr(batch, name), width, name).to(dev)
                if routed is not None:  # which stream positions hold an engine record (routing replay)
                    d["routing_valid"] = pack(pk, routed, width, "routing_valid").to(dev)
                pos = pk.position_ids().to(dev)
                d.update(pack=pk, tokens=d["packed/tokens"].unsqueeze(0), position_ids=pos,
                         packed_seq_params=pk.packed_seq_params(dev, self.host_cu_seqlens,
                                                                pos if self.rope_per_token and cp == 1 else None),
                         width=width)
                unpack_index(pk, width - 1, width, dev)  # built now: the loss function then copies nothing to dev
                if self.vision is not None:  # MRoPE positions [3, 1, S] and the stream's images
                    d.update(self.vision.packed_inputs(batch, pk, width, dev))
                if cp > 1:  # this rank's positions of the stream, and the token each of them predicts
                    mine = pk.cp_indices(cp, cp_rank).to(dev)
                    labels = torch.roll(d["tokens"], -1, dims=1)
                    d.update(tokens=d["tokens"][:, mine], labels=labels[:, mine], position_ids=d["position_ids"][:, mine],
                             cp_index=torch.cat([pk.cp_indices(cp, j) for j in range(cp)]).to(dev), cp_positions=mine)
            elif cp > 1:
                d.update(padded_cp_inputs(batch.tokens[rows], cp, cp_rank,
                                          chunk_multiple=ps.get_tensor_model_parallel_world_size() if sp else 1))
                d = {k: v.to(dev) if torch.is_tensor(v) and k != "rows" else v for k, v in d.items()}
            else:
                d["tokens"] = batch.tokens[rows].to(dev)
                if self.vision is not None:
                    d.update(self.vision.micro_inputs(batch, rows, dev))
                if routed is not None:
                    d.update(routing=batch.routed_experts[rows].to(dev), routing_valid=routed[rows].to(dev))
            out.append(d)
        return out

    def _replay_rows(self, batch: RolloutBatch) -> torch.Tensor | None:
        """[B, T] bool: positions whose routing the engine recorded, when this actor replays; checks the batch's
        routing against the model before any forward (one clear error, nothing run)."""
        if self.routing is None:
            return None
        r, shape = batch.routed_experts, self.routing
        if r is None:
            raise RoutingError("algo.routing_replay=rollout but the batch has no routed experts (the engine did not "
                               "record them)")
        b, t = batch.tokens.shape
        if r.dim() != 4 or tuple(r.shape) != (b, t, shape.num_layers, shape.top_k):
            raise RoutingError(f"routed experts of shape {tuple(r.shape)} do not match the batch [{b}, {t}] and the "
                               f"model ({shape.num_layers} layers, top_k {shape.top_k})")
        valid = torch.arange(t)[None, :] < (batch.seq_lens[:, None] - 1)
        for i in range(b):
            shape.check(r[i, :int(batch.seq_lens[i]) - 1], int(batch.seq_lens[i]) - 1, f"batch row {i}")
        return valid

    def routing_metrics(self) -> dict[str, float]:
        """Routing disagreement measured by the logprob passes since the last call (collective)."""
        return self.replay.take_disagreement() if self.replay is not None else {}

    def _logprobs(self, mb: dict, logits: torch.Tensor) -> torch.Tensor:
        """Per predicting position: [b, s-1] padded, [1, S-1] along the packed stream."""
        temp = self.cfg.rollout.temperature
        if "cp_index" not in mb:
            return token_logprobs(logits, mb["tokens"], self.vocab, temp, self.bitwise)
        # this CP rank's positions; labels came with them
        return self._cp_stream(mb, _chunked_logprobs(logits, mb["labels"], self.vocab, temp, self.bitwise))

    def _entropy(self, mb: dict, logits: torch.Tensor) -> torch.Tensor:
        temp = self.cfg.rollout.temperature
        if "cp_index" not in mb:
            return vocab_parallel_entropy(logits, self.vocab, temp)
        return self._cp_stream(mb, position_entropy(logits, self.vocab, temp))

    def _head_logprobs(self, mb: dict, logits: torch.Tensor) -> torch.Tensor:
        """[n, T-1, K] the trainer's logprobs of the engine's top-k tokens in the row layout (score centering)."""
        ids = mb["packed/engine_head_ids"][:-1].unsqueeze(0) if "pack" in mb else mb["head_ids"]
        return self._rows(mb, head_logprobs(logits[:, :-1], ids, self.vocab, self.cfg.rollout.temperature))

    def _cp_stream(self, mb: dict, local: torch.Tensor) -> torch.Tensor:
        """[b, t] values of this CP rank's positions -> [b, W-1] along the whole stream (packed, b = 1) or along
        each padded row, on every CP rank. Each CP rank then computes the same loss of the whole micro-batch; the
        gather keeps each rank's own gradient slice."""
        full = gather_cp(local.transpose(0, 1), ps.get_context_parallel_group(), sum_grads=False)  # [cp * t, b]
        stream = full.new_zeros(full.shape).index_copy(0, mb["cp_index"], full).transpose(0, 1)
        return stream[:, :mb.get("cp_width", stream.shape[1]) - 1]  # padded rows: drop the 2*cp alignment

    def _rows(self, mb: dict, packed_values: torch.Tensor) -> torch.Tensor:
        """A model output per predicting position ([b, s-1]) in the row layout [n, T-1] of mb["mask"]."""
        if "pack" not in mb:
            return packed_values
        return unpack(mb["pack"], packed_values[0], mb["width"] - 1, mb["width"])

    def logprobs(self, batch: RolloutBatch) -> torch.Tensor | None:
        """[B, T-1] logprobs on the last pipeline stage (None elsewhere), no grad."""

        def loss_fn(mb, logits):
            lp = self._rows(mb, self._logprobs(mb, logits))
            return torch.zeros((), device=lp.device), {"lp": lp.detach()}

        for c in self.chunks:
            c.eval()
        micro = self._micro(batch, {})
        if self.replay is not None:  # the scoring pass also counts where the trainer's own routing differs
            self.replay.measure = True
            if self.replay.own:  # algo.routing_replay=trainer: the update of this batch replays this pass
                self.replay.record_pass()
        try:
            with torch.no_grad():
                outs = self._run(micro, loss_fn, forward_only=True)
        finally:
            if self.replay is not None:
                self.replay.measure = False
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            return None
        out = torch.zeros(batch.response_mask.shape)
        for mb, o in zip(micro, outs):
            out[mb["rows"]] = o["lp"].float().cpu()
        return out

    def take_engine_gap(self) -> dict[str, float]:
        """logprob_diff/* of the forward passes probed since the last call (probe_engine_gap)."""
        gap, self._gap = self._gap, []
        count = sum(float(c) for _, c, _ in gap)
        if not count:
            return {}
        return {"logprob_diff/mean_abs": sum(float(s) for s, _, _ in gap) / count,
                "logprob_diff/max_abs": max(float(m) for _, _, m in gap)}

    def train_step(self, batch: RolloutBatch, old_lp, adv, ref_lp, norms: dict) -> dict[str, float]:
        """One optimizer step over `batch` (this DP rank's share). norms: global num_tokens / num_seqs."""
        outs = self.forward_backward(batch, old_lp, adv, ref_lp, norms)
        if self.weight_change is not None:
            self.weight_change.before_step()
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        metrics = {}
        if outs:
            for k in outs[0]:
                metrics[k] = float(torch.stack([o[k] for o in outs]).mean())
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["update_skipped"] = float(not ok)
        if self.weight_change is not None:
            metrics.update(self.weight_change.after_step())
        metrics.update(memory_metrics(self, ps.get_pipeline_model_parallel_rank()))  # after the step: Adam state exists
        return metrics

    def forward_backward(self, batch: RolloutBatch, old_lp, adv, ref_lp, norms: dict) -> list[dict]:
        """Gradients of the policy loss over `batch` in the DDP grad buffers (main_grad), DP-reduced; the
        per-micro-batch metrics on the last stage. Each micro-batch's loss is its share of the global loss
        (norms are global counts), so the sum over micro-batches and ranks does not depend on how samples
        were grouped or packed."""
        algo = self.cfg.algo
        dp = ps.get_data_parallel_world_size()
        # old/ref logprobs exist on the last pipeline stage only, which is also the only one computing a loss.
        extra = {k: v for k, v in {"old": old_lp, "adv": adv, "engine": batch.engine_logprobs, "ref": ref_lp}.items()
                 if v is not None}
        if algo.score_centering:  # the engine's top-k per token (docs/design-score-centering.md)
            if batch.engine_head_ids is None:
                raise ValueError("algo.score_centering is on but the batch has no engine top-k logprobs")
            extra.update(head_ids=batch.engine_head_ids, engine_head=batch.engine_head_logprobs)
        micro = self._micro(batch, extra)
        probe, self.probe_engine_gap = self.probe_engine_gap, False

        def loss_fn(mb, logits):
            lp = self._rows(mb, self._logprobs(mb, logits))
            if probe:
                d = (lp.detach().float() - mb["engine"].float()).abs()[mb["mask"].bool()]
                self._gap.append((d.sum(), torch.tensor(float(d.numel())), d.max() if d.numel() else d.new_zeros(())))
            ent = self._rows(mb, self._entropy(mb, logits)) if algo.entropy_coef else None
            head = self._head_logprobs(mb, logits) if algo.score_centering else None
            loss, metrics = policy_loss(algo, lp, mb["old"], mb["adv"], mb["mask"], ref_logprobs=mb.get("ref"),
                                        entropy=ent, rollout_logprobs=mb["engine"],
                                        norm_len=self.cfg.rollout.max_new_tokens, head_logprobs=head,
                                        engine_head_logprobs=mb.get("engine_head"), **norms)
            # Megatron divides by the number of micro batches and DDP averages over DP: undo both, the
            # normalisers already cover the whole global batch. (DDP's extra 1/CP is undone by Megatron's own
            # loss * cp in forward_step; every CP rank computes the whole loss, its gradients covering its own
            # positions, and DDP sums them.)
            return loss * len(micro) * dp, {k: v.detach().float() for k, v in metrics.items()}

        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.replay is not None and self.replay.own:
            self.replay.replay_pass()
        return self._run(micro, loss_fn, forward_only=False)


def vision_lr_overrides(opt_cfg, vision_lr: float) -> dict:
    """Megatron's standard parameter-group overrides plus one: the fully trained vision tower of a LoRA run keeps
    optim.lr (its scheduler's peak), while model.lora.lr is the adapters' (the optimizer's base lr)."""
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey
    # DDP / Float16Module prefix the names with module.: match the tower anywhere in the path
    return {**get_standard_config_overrides(opt_cfg), ParamKey(name=f"*{MEGATRON_VISION}*"): {"max_lr": vision_lr}}
