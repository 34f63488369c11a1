"""Each GPU's memory, planned from the config and the model's shape before any process group starts.

Per training rank (the heaviest pipeline stage), in bytes:
- weights: the rank's parameters (model.dtype), counted from the layout table (mtrain/layouts) with its tensor-,
  pipeline- and expert-parallel split;
- gradients: fp32 (DDP's grad_reduce_in_fp32) for the trainable parameters (the adapters alone with model.lora);
- the KL reference model (algo.kl_coef > 0): a frozen copy of the base weights (PPO's critic and a distillation
  teacher are not counted yet);
- main copy: fp32 master weights of bf16 trainable parameters; Adam: two fp32 moments. Both divided over data
  parallelism with the distributed optimizer, and on the host with optim.cpu_offload. Adam's moments exist from
  the first optimizer step on (torch's Adam creates them lazily);
- activations: what the backward keeps of one micro-batch at the token budget (train.max_tokens_per_micro_batch,
  else micro_batch_size x (max_prompt_len + max_new_tokens)): per token and layer the bf16 tensors a Megatron
  layer without recomputation saves (norm inputs and outputs, q/k/v before and after RoPE and the QK norm, the
  attention output, the gated MLP's three inputs); with train.recompute=full only each layer's input; plus the
  logits (bf16 output, its [b, s] transpose and its gradient: the scoring's float32 work is chunked,
  mtrain/models/token_logprobs.py).
- the engine (SGLang colocated on the same GPU): its share is `mem_fraction_static` of the memory free when it
  starts (SGLang keeps (1 - fraction) of what it found free as headroom: model_runner's pre_model_load_memory), so
  the trainer's resident state at that moment shrinks it. Its weights come out of that share; the rest is KV cache.
  With engine.colocate the engine hands weights and KV cache back while training runs; with rollout.async it stays.

- what the counted terms leave out, as measured on the GPU (docs/design-memory-plan.md): SGLang's memory outside
  its static share (CUDA graphs, which stay while training runs, its prefill and sampler work space), and the
  training step's allocator slack (the caching allocator's blocks, split by packed micro-batches of varying
  length, held beyond what is allocated), taken as one more activation working set.

Peak = max(rollout: engine + trainer state, training: trainer state + activations + slack [+ engine if resident])
plus the engine's outside work space and one CUDA context per process. A layout whose peak exceeds the device, or
whose engine is left no KV cache for one sample, is refused in one line that says what to change. An estimate, not a
guarantee (docs/results.md has planned against measured peaks).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 1 << 30
CUDA_CONTEXT = int(0.6 * GIB)  # one process's CUDA context and library handles (cuBLAS workspace, NCCL)
# Memory beside the counted terms with a colocated engine, beyond the CUDA contexts (SGLang's graphs, prefill and
# sampler work space, and what else the two processes hold: not yet measured apart). Fitted to two runs on one
# H100, not derived:
# - Qwen3-1.7B's shape (28 layers x 2,048), engine at 0.5, 2026-12-06: the GPU's peak, in rollout, 5.1 GiB above
#   the plan (67.0 measured, 61.3 planned);
# - Qwen3-4B's shape (36 x 2,560), engine.offload_train, 2026-12-07: out of memory in the first optimizer step, the
#   two processes holding 10.0 GiB beside PyTorch's blocks, 3.7 more than the contexts and the 1.7B figure, and the
#   plan short by at least 1.3 GiB (docs/design-memory-plan.md).
# Scaled by layers x hidden size against the 1.7B shape, never below its figure: 5.1 GiB there, 8.2 GiB for the 4B
# shape, whose layout the plan then refuses.
ENGINE_OUTSIDE_SHARE = int(5.1 * GIB)
OUTSIDE_SHARE_SHAPE = 28 * 2048  # the shape ENGINE_OUTSIDE_SHARE was measured on: layers x hidden size


def engine_outside_share(hf_config: dict) -> int:
    """ENGINE_OUTSIDE_SHARE for this model's shape (layers x hidden size against the 1.7B shape, at least 1x)."""
    size = int(hf_config.get("num_hidden_layers", 0)) * int(hf_config.get("hidden_size", 0))
    return int(ENGINE_OUTSIDE_SHARE * max(1.0, size / OUTSIDE_SHARE_SHAPE))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _split(w, tp: int, ep: int, etp: int) -> int:
    """This rank's share of weight `w`'s elements under Megatron's tensor and expert parallelism."""
    from mtrain.layouts.rules import Replicated
    n = _numel(w.shape)
    split = not all(isinstance(p.rule, Replicated) for p in w.megatron)
    if w.expert is not None:
        return n // ep // (etp if split else 1)
    return n // (tp if split else 1)


def rank_params(layout, weights, tp: int, pp: int, ep: int, etp: int, stage_layers: list[int]) -> list[int]:
    """Parameters held by one rank of each pipeline stage (embedding on the first, head and final norm on the last:
    a tied head is its own copy there when pp > 1, the embedding itself when pp = 1). Experts: num_experts / ep."""
    starts = [sum(stage_layers[:i]) for i in range(pp)]
    out = [0] * pp
    for w in weights:
        n = _split(w, tp, ep, etp)
        if w.region == "embed":
            out[0] += n
        elif w.key == "lm_head" and layout.tied_embeddings and pp == 1:
            continue  # one tensor with the embedding (the layout lists the head as its alias)
        elif w.region in ("final", "mtp"):
            out[-1] += n
        elif w.layer is not None:
            out[max(i for i in range(pp) if starts[i] <= w.layer)] += n
        else:  # vision tower and the like: the first stage
            out[0] += n
    return out


def optimizer_bytes(trainable: int, weight_bytes: int, shard: int, on_host: bool) -> tuple[int, int]:
    """(fp32 main copy, Adam's two fp32 moments) on the device for `trainable` parameters, divided over `shard`
    data-parallel ranks (the distributed optimizer); none with optim.cpu_offload, no main copy for fp32 weights."""
    if on_host:
        return 0, 0
    return (0 if weight_bytes == 4 else 4 * trainable // shard), 8 * trainable // shard


def activation_bytes_per_token_layer(hf: dict, tp: int, recompute: str) -> int:
    """bf16 bytes one decoder layer keeps per token for its backward (see the module's note)."""
    h = hf["hidden_size"]
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    hd = hf.get("head_dim") or h // heads
    if recompute == "full":
        return 2 * h
    experts = hf.get("num_experts") or hf.get("n_routed_experts") or 0
    if experts:  # the routed tokens' MLP inputs, top_k of them per token
        inter = (hf.get("moe_intermediate_size") or hf["intermediate_size"]) * (hf.get("num_experts_per_tok") or 1)
    else:
        inter = hf["intermediate_size"]
    attn = (heads + 2 * kv) * hd + 2 * (heads + kv) * hd + heads * hd  # qkv; after qk-norm and RoPE; context
    if recompute == "selective":  # core attention recomputed: its output is not kept
        attn -= heads * hd
    return 2 * (4 * h + attn // tp + 3 * inter // tp)


@dataclass
class MemoryPlan:
    device_bytes: int
    weights: int
    grads: int
    main: int
    adam: int
    activations: int
    logits: int
    engine: int  # the engine's whole share (weights + KV cache); 0 without a colocated engine
    engine_weights: int
    kv_tokens: int  # tokens the engine's KV cache holds
    sample_tokens: int  # one sample's longest prompt + response
    engine_resident_in_training: bool
    state_at_engine_start: int = 0
    reference: int = 0  # the frozen KL reference model's weights (algo.kl_coef > 0)
    offloaded_in_rollout: int = 0  # engine.offload_train: grads, main copy and Adam on the host while generating
    outside_share: int = ENGINE_OUTSIDE_SHARE  # engine_outside_share(model): what a colocated engine adds uncounted
    full_recompute: bool = False  # train.recompute.granularity=full already: the refusal does not suggest it

    @property
    def state(self) -> int:
        return self.weights + self.reference + self.grads + self.main + self.adam

    @property
    def engine_outside(self) -> int:
        return self.outside_share if self.engine else 0

    @property
    def slack(self) -> int:
        """The training step's allocator slack: one more activation working set (the Qwen3-1.7B shape's GPU peak in
        training less the trainer's allocated peak, SGLang's outside share and the contexts: 11.5 GiB, against 11.8
        GiB of activations and logits; docs/design-memory-plan.md)."""
        return self.activations + self.logits

    @property
    def fixed(self) -> int:
        """What every phase holds besides the trainer and the engine's share: CUDA contexts, the engine's outside."""
        return (2 if self.engine else 1) * CUDA_CONTEXT + self.engine_outside

    @property
    def rollout_peak(self) -> int:
        return self.engine + self.state - self.offloaded_in_rollout + self.fixed

    @property
    def train_peak(self) -> int:
        engine = self.engine if self.engine_resident_in_training else 0
        return self.state + self.activations + self.logits + self.slack + engine + self.fixed

    @property
    def peak(self) -> int:
        return max(self.rollout_peak, self.train_peak)

    def breakdown(self) -> str:
        g = lambda b: f"{b / GIB:.1f}"  # noqa: E731
        ref = f" + reference model {g(self.reference)}" if self.reference else ""
        out = (f"weights {g(self.weights)}{ref} + grads {g(self.grads)} + main copy {g(self.main)} + Adam {g(self.adam)} "
               f"+ activations {g(self.activations)} + logits {g(self.logits)} + allocator slack {g(self.slack)} GiB")
        if self.engine:
            out += (f"; engine {g(self.engine)} GiB (weights {g(self.engine_weights)}, KV cache for "
                    f"{self.kv_tokens:,} tokens{', resident while training' if self.engine_resident_in_training else ''})"
                    f" + {g(self.engine_outside)} GiB outside its share")
        return out

    def line(self) -> str:
        g = lambda b: f"{b / GIB:.1f}"  # noqa: E731
        return (f"memory plan per GPU: {self.breakdown()}; peak {g(self.peak)} GiB (rollout {g(self.rollout_peak)}, "
                f"training {g(self.train_peak)}) of {g(self.device_bytes)} GiB")

    def problem(self) -> str | None:
        """The one-line refusal (starting with the config key to change), or None when the plan fits."""
        g = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
        if self.peak <= self.device_bytes:  # the whole layout first: more engine share cannot mend a trainer too big
            return self._kv_problem()
        fixes = []
        if self.rollout_peak > self.device_bytes:
            fixes.append("set engine.offload_train=true (grads, main copy and Adam on the host while generating) or "
                         "lower engine.mem_fraction_static")
        if self.train_peak > self.device_bytes:
            if self.engine_resident_in_training:
                fixes.append("set rollout.async=off (the engine then leaves the GPU while training runs)")
            if self.activations + self.logits + self.slack > self.train_peak - self.device_bytes:
                fixes.append("lower train.max_tokens_per_micro_batch" + (
                    "" if self.full_recompute else " or set train.recompute.granularity=full"))
        fixes.append("set optim.cpu_offload=true (with optim.use_distributed_optimizer), shard over more ranks "
                     "(parallel.tp/pp, data parallelism with the distributed optimizer) or use model.lora")
        key = fixes[0].split("=")[0].split()[-1]
        return (f"{key}: the memory plan does not fit one GPU ({g(self.peak - self.device_bytes)} over): peak "
                f"{g(self.peak)} per GPU (rollout {g(self.rollout_peak)}, training {g(self.train_peak)}) > "
                f"{g(self.device_bytes)}; {self.breakdown()}; to fit: {'; or '.join(fixes)}")

    def _kv_problem(self) -> str | None:
        g = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
        if self.engine and self.kv_tokens < self.sample_tokens:
            return (f"engine.mem_fraction_static: the engine's share ({g(self.engine)} of the "
                    f"{g(self.device_bytes - self.state_at_engine_start)} free when it starts, the trainer holding "
                    f"{g(self.state_at_engine_start)}) leaves KV cache for {self.kv_tokens:,} tokens, less than one "
                    f"sample's {self.sample_tokens:,} (its weights take {g(self.engine_weights)}): raise "
                    f"engine.mem_fraction_static, shard over more ranks (parallel.tp, engine.tp) or use model.lora")
        return None


def plan(cfg, hf_config: dict, dp: int, device_bytes: int, colocated_engine: bool) -> MemoryPlan:
    """The plan of one training rank of `cfg` on a GPU of `device_bytes`; colocated_engine: an SGLang engine
    shares this GPU (engine.placement=colocated on CUDA)."""
    from mtrain.layouts import model_layout
    from mtrain.layouts.lora import LoraSpec, lora_layout
    from mtrain.reshard.placement import MegatronLayout
    p = cfg.parallel
    layout = model_layout(hf_config, mtp=False)
    etp = p.etp or p.tp
    stages = MegatronLayout(tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=p.etp, cp=p.cp, dp=dp,
                            first_stage_layers=p.first_stage_layers,
                            last_stage_layers=p.last_stage_layers).stage_layers(layout.num_layers)
    params = rank_params(layout, layout.weights, p.tp, p.pp, p.ep, etp, stages)
    lo = cfg.model.lora
    if lo.targets:
        adapters = lora_layout(layout, LoraSpec(lo.rank, float(lo.alpha), tuple(lo.targets)))
        trainable = rank_params(layout, adapters.weights, p.tp, p.pp, p.ep, etp, stages)
        params = [a + b for a, b in zip(params, trainable)]
    else:
        trainable = params
    stage = max(range(p.pp), key=lambda i: params[i])  # the heaviest stage's ranks
    n, t = params[stage], trainable[stage]
    wbytes = 2 if cfg.model.dtype == "bfloat16" else 4
    main, adam = optimizer_bytes(t, wbytes, dp if cfg.optim.use_distributed_optimizer else 1, cfg.optim.cpu_offload)
    r, tr = cfg.rollout, cfg.train
    sample = r.max_prompt_len + r.max_new_tokens
    tokens = tr.max_tokens_per_micro_batch or tr.micro_batch_size * sample
    tokens = -(-tokens // p.cp)  # context parallelism splits each stream
    layers = stages[stage] * (p.vpp or 1)
    act = tokens * layers * activation_bytes_per_token_layer(hf_config, p.tp, tr.recompute.granularity)
    vocab_local = -(-layout.vocab_size // (128 * p.tp)) * 128
    logits = 3 * tokens * vocab_local * 2 if stage == p.pp - 1 else 0
    out = MemoryPlan(device_bytes=device_bytes, weights=n * wbytes, grads=4 * t, main=main, adam=adam,
                     activations=act, logits=logits, engine=0, engine_weights=0, kv_tokens=0, sample_tokens=sample,
                     engine_resident_in_training=False, full_recompute=tr.recompute.granularity == "full",
                     reference=((n - t) if lo.targets else n) * wbytes if cfg.algo.kl_coef else 0)
    if colocated_engine:
        e = cfg.engine
        ebytes = {"fp8": 1, "float32": 4}.get(cfg.engine_dtype, 2)
        total = rank_params(layout, layout.weights, 1, 1, 1, 1, [layout.num_layers])[0]
        out.engine_weights = total * ebytes // e.tp
        # the trainer's state when the engine starts (Actor built: weights, grads, main copy; Adam not yet)
        out.state_at_engine_start = out.weights + out.reference + out.grads + out.main + CUDA_CONTEXT
        out.engine = int(e.mem_fraction_static * (device_bytes - out.state_at_engine_start))
        h = hf_config
        kv_heads = h.get("num_key_value_heads") or h["num_attention_heads"]
        hd = h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]
        per_token = 2 * layout.num_layers * max(kv_heads // e.tp, 1) * hd * 2  # K and V, bf16
        out.kv_tokens = max(out.engine - out.engine_weights, 0) // per_token
        out.engine_resident_in_training = cfg.rollout.async_mode != "off" or not e.colocate
        out.outside_share = engine_outside_share(hf_config)
        if e.offload_train:
            out.offloaded_in_rollout = out.grads + out.main + out.adam
    return out


def report(cfg, hf_config: dict, dp: int) -> str | None:
    """preflight's hook: on a CUDA machine, prints the plan's line (the first rank) or raises ConfigError (one line,
    every rank) when it cannot fit; nothing on CPU (engine and trainer share host memory: nothing to plan)."""
    line = check(cfg, hf_config, dp)
    if line and int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)
    return line


def check(cfg, hf_config: dict, dp: int) -> str | None:
    """The plan's line on a CUDA machine, ConfigError when it cannot fit, None on CPU."""
    import torch

    from mtrain.config import ConfigError
    if not torch.cuda.is_available():
        return None
    # the device's total from its properties: no CUDA context is created here, before the process groups exist
    device_bytes = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory
    from mtrain.trainer.decisions import engine_kind
    colocated = cfg.engine.placement == "colocated" and engine_kind(cfg.engine, True) == "sglang"
    p = plan(cfg, hf_config, dp, device_bytes, colocated)
    err = p.problem()
    if err:
        raise ConfigError(err)
    return p.line()
