"""The sections of a run's config: one dataclass per top-level key (model, parallel, engine, rollout, ...) and
`RunConfig`, the tree of them. Loading, overrides and presets live in `mtrain.config`; cross-field checks in
`mtrain.config_checks`. This module imports neither, so both may read these types.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mtrain.config_data import DataConfig, RewardConfig  # noqa: F401  (the data and reward sections)
from mtrain.fileperm import replace_text


# Config keys that cannot be field names (Python keywords): field name -> the key users write (YAML, overrides,
# config.yaml, error messages). The field name itself is not a key.
USER_KEYS = {"async_mode": "async"}
_FIELDS = {v: k for k, v in USER_KEYS.items()}


def _key_of(name: str) -> str:
    return USER_KEYS.get(name, name)


def _field_of(key: str) -> str:
    return _FIELDS.get(key, key)


def _user_keys(tree: Any) -> Any:
    """asdict() output with field names turned into the keys users write."""
    if isinstance(tree, dict):
        return {_key_of(k) if isinstance(k, str) else k: _user_keys(v) for k, v in tree.items()}
    return tree


# Keys whose value is a secret -> where to give it instead. Never on a command line (/proc/PID/cmdline:
# config_checks.refuse_secret_overrides) and never in a config dump, log or tracker (RunConfig.to_dict).
SECRET_KEYS = {"serve.api_key": "serve.api_key_env (default $MTRAIN_API_KEY)"}

# Keys whose value is a file or folder, or may name one ("path/to/file.py:function", train.resume's checkpoint):
# `~` in them is expanded once, when the config is loaded (mtrain.config.expand_user_paths), so every reader gets
# a path the filesystem knows. List keys (multi_turn.tools) are expanded item by item.
PATH_KEYS = ("model.hf_path", "model.mcore_ckpt", "critic.hf_path", "algo.distill.teacher_path", "data.train_path",
             "data.eval_path", "reward.fn", "reward.judge.hf_path", "train.run_dir", "train.resume",
             "multi_turn.rollout_fn", "multi_turn.tools", "multi_turn.retrieval_corpus", "serve.agent")


@dataclass
class LoraConfig:
    """Low-rank adapters on the policy's linear layers (docs/design-lora.md); empty targets: full fine-tuning."""
    rank: int = 16
    alpha: float = 32.0  # the update is (alpha / rank) * B @ A
    dropout: float = 0.0  # on the adapter's input, as PEFT's lora_dropout
    # a subset of config_checks.LORA_TARGETS (the layout tables' names: qkv, o_proj, gate_up, down, experts, ...)
    targets: list[str] = field(default_factory=list)
    lr: float | None = None  # the adapters' learning rate (LoRA wants a larger one than full tuning); null: optim.lr


@dataclass
class ModelConfig:
    hf_path: str = ""  # HF model dir with config.json (and tokenizer files unless a tiny tokenizer is used)
    mcore_ckpt: str | None = None  # Megatron dist checkpoint to start from instead of the HF weights
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    # Build the policy with the checkpoint's multi-token-prediction layers (DeepSeek-V3). RL trains the main
    # model only (as verl's recipe): false drops them from the trained model; the converted checkpoint keeps them.
    mtp: bool = False
    # Vision-language models (Qwen2.5-VL): train the vision tower and patch merger too (docs/design-vlm.md); false
    # keeps them frozen (no gradients, no optimizer state) while the language model trains.
    train_vision: bool = False
    # The language-model head (logits) in float32 on both sides: the trainer's output layer multiplies float32
    # copies of its input and weight, and SGLang engines start with enable_fp32_lm_head. A bf16 head rounds every
    # logit to 8 mantissa bits before the softmax, on each side differently (docs/design-gpu-recipe.md).
    fp32_lm_head: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline stages per PP rank (needs pp > 1)
    ep: int = 1
    etp: int | None = None  # expert TP; None = same as tp
    cp: int = 1  # context parallelism: every sequence (packed or padded row) split over cp ranks (docs/design-packing.md)
    sequence_parallel: bool | None = None  # None: on with Transformer Engine and tp > 1 (the local norm refuses it)
    # megatron-core's uneven pipeline split (num_layers_in_first/last_pipeline_stage), e.g. 61 layers on pp 16
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None


@dataclass
class EngineConfig:
    kind: Literal["auto", "sglang", "reference"] = "auto"  # auto: sglang on GPU, reference on CPU
    tp: int = 1
    ep: int = 1  # SGLang expert parallelism inside the engine's TP group (MoE over ep x tp/ep)
    mem_fraction_static: float = 0.5
    attention_backend: str | None = None  # SGLang's attention_backend; None = "triton" (rollout/sglang_wire.py)
    nnodes: int = 1  # nodes one SGLang engine spans (engine.tp = nnodes x ranks per node); docs/design-pool.md
    colocate: bool = True  # engines release weights + KV cache while training runs, and take them back for rollout
    offload_train: bool = False  # move grads/optimizer state to host while the engines generate (metrics: offload/*)
    # auto: the engine holds the trainer's dtype. bfloat16: a bf16 engine under a float32 trainer (model.dtype=
    # float32; SGLang has no float32 RMSNorm), the sync casting as it copies; the trainer's logprobs are then
    # float32-exact and the engine-vs-trainer gap is the engine's bf16 rounding alone (docs/design-gpu-recipe.md).
    # fp8: SGLang's block-FP8 layout (float8_e4m3fn + 128x128 scales for every linear layer); each sync quantizes
    # inside the resharding kernel. The CPU reference engine emulates it (quantize-dequantize with the same block
    # math). docs/fp8.md
    weight_dtype: str = "auto"
    # with weight_dtype=fp8, SGLang's FP8 format: block (DeepSeek's 128x128 blocks: every fused part's per-rank rows
    # a multiple of 128), channel (one scale per output row, what SGLang makes of a bf16 model itself; dense models
    # only, e.g. SmolLM2-135M), auto: block where the model and engine tp/ep allow it, else channel. docs/fp8.md
    fp8_scaling: str = "auto"
    # Further `sglang.Engine` arguments (SGLang ServerArgs names), applied after mtrain's own choices
    # (rollout/sglang_wire.py), e.g. {disable_cuda_graph: false} for long runs; on the command line
    # engine.server_args.disable_cuda_graph=false. Keys that other config keys or the weight layout decide are
    # refused (mtrain/engine_args.py); names SGLang does not know are refused before the engine starts.
    server_args: dict[str, Any] = field(default_factory=dict)
    # SGLang decode CUDA graphs (3.6x the rollout speed of the SmolLM2 demo on an H200). Their memory stays on the
    # GPU while training runs: SGLang 0.5.17 pauses graph memory only with torch_memory_saver's LD_PRELOAD hook
    # ("Only hook_mode=preload supports pauseable CUDA Graph"), which an engine inside the trainer cannot use.
    # false: no capture (a faster start, for tests).
    cuda_graphs: bool = True
    # the largest decode batch captured (SGLang's cuda_graph_max_bs_decode); null: the requests one engine runs at
    # once (min(prompts_per_step, max_groups_in_flight) x samples_per_prompt, rounded up to a multiple of 8)
    cuda_graph_max_bs: int | None = None
    # Where engines live (docs/design-async.md): colocated = every rank trains and hosts (a part of) an engine;
    # separate = the last `engine.ranks` ranks host engines, the others train.
    placement: Literal["colocated", "separate"] = "colocated"
    ranks: int | None = None  # separate placement: ranks hosting engines (a multiple of engine.tp)


@dataclass
class RolloutConfig:
    prompts_per_step: int = 8
    samples_per_prompt: int = 4  # the group size of group-baseline algorithms
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the tokenizer's eos
    max_prompt_len: int = 256
    max_groups_in_flight: int = 16  # per engine: GRPO groups it runs at once (claimed from the pool's shared queue)
    # Partial rollout (docs/design-partial-rollout.md): over-sample, train on the first prompts_per_step groups that
    # finish, keep the rest (with the weight version of every token) in a buffer and resume them next step.
    partial: bool = False
    # groups kept in flight / groups trained (>= 1; partial only; null = PARTIAL_OVER_SAMPLE with partial, where
    # the engines run at most max_groups_in_flight groups each)
    over_sample: float | None = None
    offpolicy: Literal["mask", "tis"] = "mask"  # tokens of older versions: out of the loss, or TIS (algo.tis_cap)
    # partial: drop buffered groups with tokens more than this many versions old; rollout.async: the most versions
    # a trained token may lag (one_step with offpolicy=mask; stream: its generator waits to keep it; null = 1)
    max_staleness: int | None = None
    max_new_tokens_start: int | None = None  # growing length budget: start here, reach max_new_tokens ...
    max_new_tokens_ramp_steps: int = 0  # ... linearly over this many steps (0 = no ramp)
    # Asynchronous RL (docs/design-async.md): off | one_step (step N+1's groups generated with weights N while step
    # N trains) | stream. Its key is `rollout.async` (a Python keyword, hence the field name: USER_KEYS).
    async_mode: Literal["off", "one_step", "stream"] = "off"


# Partial rollout's default over-sampling: twice the trained groups in flight. On the longtail task the H200 A/B
# (docs/results.md, issue 11) and the model in benchmarks/sim_partial_rollout.py put most of the gain in keeping the
# slots full past the tail; 2 adds ~25 % over 1 there, 4 another ~10 % at the price of more off-policy tokens.
PARTIAL_OVER_SAMPLE = 2.0

ALGO_NAMES = ("grpo", "dr_grpo", "dapo", "gspo", "reinforce_pp")
# Paper defaults per algorithm. Any knob the user sets explicitly wins over its preset.
ALGO_PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeekMath GRPO: group-std advantages, per-sequence token mean, k3 KL to the reference.
    "grpo": dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.001, kl_estimator="k3",
                 adv_norm="group_std", loss_agg="seq_mean_token_mean", filter_uniform_groups=False),
    # Dr. GRPO: no std division, no length normalisation per sequence (constant normaliser).
    "dr_grpo": dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0, kl_estimator="k3",
                    adv_norm="none", loss_agg="seq_mean_token_sum_norm", filter_uniform_groups=False),
    # DAPO: clip-higher, token-level loss, no KL, dynamic sampling (drop groups with equal rewards).
    "dapo": dict(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.0, kl_estimator="k3",
                 adv_norm="group_std", loss_agg="token_mean", filter_uniform_groups=True),
    # GSPO: sequence-level importance ratio with a tiny clip range.
    "gspo": dict(clip_eps_low=3e-4, clip_eps_high=4e-4, kl_coef=0.0, kl_estimator="k3",
                 adv_norm="group_std", loss_agg="seq_mean_token_mean", filter_uniform_groups=False),
    # REINFORCE++-baseline: group-mean baseline, then whitening over the whole batch; k2 KL in the loss.
    "reinforce_pp": dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.001, kl_estimator="k2",
                         adv_norm="batch_std", loss_agg="token_mean", filter_uniform_groups=False),
    # PPO with a value model (critic.*): GAE advantages whitened over the batch (adv_norm=batch_std; none: raw).
    "ppo": dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0, kl_estimator="k3",
                adv_norm="batch_std", loss_agg="token_mean", filter_uniform_groups=False),
}


@dataclass
class DistillConfig:
    """On-policy distillation (docs/design-critic-distill.md): a frozen teacher scores the sampled tokens."""
    teacher_path: str = ""  # HF model dir of the teacher (same tokenizer and vocabulary as model.hf_path); "" = off
    coef: float | None = None  # weight of the per-token reverse KL in the advantage; None = 1.0 with a teacher
    only: bool | None = None  # True: the distillation signal alone, the task reward's advantage is not used


@dataclass
class CriticConfig:
    """PPO's value model (algo.name=ppo; docs/design-critic-distill.md): the policy's architecture with a scalar
    head, on the policy's parallel layout, its own Adam (optim.* but for the learning rate)."""
    hf_path: str | None = None  # weights to start from; null = the policy's model.hf_path
    lr: float = 1e-5
    warmup_steps: int = 0  # the first N steps update the critic only (the policy waits for a useful baseline)
    value_clip: float = 0.5  # PPO value clipping around the rollout's values (verl's cliprange_value)
    gamma: float = 1.0  # GAE discount
    lam: float = 1.0  # GAE lambda


@dataclass
class AlgoConfig:
    name: Literal["grpo", "dr_grpo", "dapo", "gspo", "reinforce_pp", "ppo"] = "grpo"
    # None = take the value from ALGO_PRESETS[name]
    clip_eps_low: float | None = None
    clip_eps_high: float | None = None
    dual_clip_c: float | None = None  # dual-clip PPO lower bound for negative advantages (e.g. 3.0)
    kl_coef: float | None = None  # KL(policy || reference) in the loss; 0 = no reference model needed
    kl_estimator: Literal["k1", "k2", "k3"] | None = None
    adv_norm: Literal["group_std", "batch_std", "none"] | None = None
    # the critic-free baseline: the group's mean reward, or each sample's leave-one-out mean of the others (RLOO,
    # mtrain/trainer/learner/leave_one_out.py)
    baseline: Literal["group_mean", "leave_one_out"] = "group_mean"
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                      "seq_mean_token_sum_norm"] | None = None
    filter_uniform_groups: bool | None = None  # DAPO dynamic sampling: drop groups whose rewards are all equal
    entropy_coef: float = 0.0
    adv_eps: float = 1e-6
    tis_cap: float | None = None  # truncated importance sampling cap for engine-vs-trainer logprob mismatch
    # MoE routing replay (docs/design-routing-replay.md): "rollout" (R3) = engines record every token's routed experts
    # and the trainer's routers replay them in the logprob pass and the update; "trainer" = the update replays the
    # old-policy scoring pass's own routing; "off" = each forward routes itself
    routing_replay: Literal["off", "rollout", "trainer"] = "off"
    # score centering (docs/design-score-centering.md): engines return each token's top-k logprobs and the loss gets
    # the additive term that cancels the sampler/trainer drift (composes with tis_cap); k = score_centering_k
    score_centering: bool = False
    score_centering_k: int = 128
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    eps: float = 1e-8
    clip_grad: float = 1.0  # 0 = no clipping
    use_distributed_optimizer: bool = True
    # megatron-core optimizer_cpu_offload: fp32 master weights + Adam moments live on the host and the Adam step
    # runs on the CPU (HybridDeviceOptimizer, offload fraction 1); needs use_distributed_optimizer.
    cpu_offload: bool = False


@dataclass
class RecomputeConfig:
    """megatron-core activation recomputation (TransformerConfig recompute_granularity/method/num_layers)."""
    granularity: Literal["none", "full", "selective"] = "none"  # selective: core attention only (Megatron's default)
    method: Literal["uniform", "block"] = "uniform"  # full only: uniform chunks, or the first num_layers per stage
    num_layers: int = 1  # full only: layers per recomputed chunk (uniform) or recomputed layers per stage (block)


@dataclass
class MultiTurnConfig:
    """Multi-turn tool rollouts (mtrain/rollout/agents/multi_turn.py, docs/design-tools.md)."""
    # per-group rollout function, "module:function" (mtrain.rollout.agents.multi_turn:rollout_group for tools);
    # None = the single-turn rollout
    rollout_fn: str | None = None
    # builtin "python" | "search" | "calculator", or "module:Name" for a BaseTool subclass / factory
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    tool_parser: Literal["qwen25", "qwen", "hermes"] = "qwen25"
    parser_backend: Literal["auto", "sglang", "mtrain"] = "auto"  # auto: SGLang's parser where it imports
    max_turns: int = 4  # model turns per trajectory
    max_total_tokens: int = 1024  # prompt + every turn + every tool result
    max_tool_calls_per_turn: int = 4  # parallel calls in one turn; more are answered with an error message
    tool_timeout_s: float = 10.0
    tool_output_max_chars: int = 2000
    tool_reward_weight: float = 0.0  # reward += weight * sum of the tools' calc_reward
    system_prompt: str | None = None  # None = a built-in prompt that lists the tools and the call format
    sandbox_wall_s: float = 10.0
    sandbox_cpu_s: int = 5
    sandbox_memory_mb: int = 512
    sandbox_max_procs: int = 16
    sandbox_disk_mb: int = 64  # all a python call may have written at once (scratch, /tmp, /dev/shm): killed beyond
    sandbox_max_files: int = 1000  # files and folders a python call may have at once (same places)
    sandbox_network: bool = True  # false: each python call in a network namespace of its own (root only)
    retrieval_corpus: str | None = None  # .txt (a document per line) / .jsonl {"text"}; None = generated towns
    retrieval_top_k: int = 2


@dataclass
class WandbConfig:  # train.log_wandb: the run in Weights & Biases (mtrain/wandb_log.py)
    project: str = "mtrain"
    entity: str | None = None  # None: the account's default
    name: str | None = None  # None: the run_dir's folder name
    tags: list[str] = field(default_factory=list)
    mode: Literal["online", "offline"] | None = None  # None: WANDB_MODE, else online; offline: no network, `wandb sync`


@dataclass
class TrainConfig:
    steps: int = 100
    micro_batch_size: int = 4  # samples per padded micro-batch (used when max_tokens_per_micro_batch is unset)
    # Set: packed micro-batches of at most this many tokens per GPU (x parallel.cp per micro-batch), samples
    # balanced over DP ranks by token count (docs/design-packing.md); unset: padded micro-batches of
    # micro_batch_size samples.
    max_tokens_per_micro_batch: int | None = None
    global_batch_size: int | None = None  # samples per optimizer step; None = the whole rollout batch
    seed: int = 1234
    run_dir: str = "runs/default"
    save_interval: int = 0  # 0 = only at the end; -1 = never (smoke runs and benchmarks: no full checkpoint)
    eval_interval: int = 0  # 0 = no periodic eval
    eval_samples: int = 1  # responses generated per eval prompt
    val_before_train: bool = False
    val_only: bool = False
    # "auto" (latest in run_dir if any), "never", or a checkpoint path; what is not the resumed history moves to
    # RUN_DIR/previous/ (mtrain/trainer/run_dir.py)
    resume: str = "auto"
    # The newest N complete checkpoints stay in RUN_DIR/checkpoints, older ones are deleted after each save (a full
    # SmolLM2-135M checkpoint with Adam's state is ~2 GB); None keeps every one.
    keep_checkpoints: int | None = 2
    # Bound on any one collective (every rank waits in one while the leader generates, so it must exceed the
    # longest rollout or eval): a dead or hung rank then ends the job with an error instead of a silent hang.
    collective_timeout_s: float = 1800.0
    # Megatron's distributed-optimizer checkpoint format. fully_reshardable: resume at any TP/PP/DP layout; saving
    # gathers each data-parallel group's optimizer state in host memory. dp_reshardable: no gather, resume at the
    # same TP/PP layout only (for models whose gathered state does not fit a host). docs/design-trainer.md.
    optimizer_checkpoint: Literal["fully_reshardable", "dp_reshardable"] = "fully_reshardable"
    log_tensorboard: bool | None = None  # None: when tensorboard is installed; true: required (error if absent)
    log_wandb: bool = False  # metrics (the names of metrics.jsonl), the config and eval samples to Weights & Biases
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # metrics weights/*: the share of model (training-dtype) elements each optimizer step changes, and how far the
    # float32 main copy and the model copy have moved since the first step (a copy of the weights is kept for it)
    log_weight_change: bool = False
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    # a group's shared prompt computed once per micro-batch, its samples attending to it (packed micro-batches;
    # docs/design-shared-prefix.md)
    shared_prefix: bool = False


@dataclass
class SyncConfig:
    bucket_mb: int = 512
    backend: Literal["auto", "triton", "torch"] = "auto"
    # push: the trainer packs buckets the engine's loader copies in; pull: the engine writes its parameters from
    # the trainer's tensors in place (one pass, one engine call; engine.tp == 1 for now); auto: pull where it
    # applies. docs/design-resharding.md, "Pull mode".
    mode: Literal["auto", "pull", "push"] = "auto"
    # engine.placement=separate: send each engine rank only the elements whose bits changed since the last sync
    # (indices + values), whole buffers where that is not smaller; bit-exact. docs/design-delta-sync.md.
    delta: bool = False


@dataclass
class ServeConfig:
    """The OpenAI front (mtrain/serve/, docs/design-openai-front.md): `mtrain serve` and agent rollouts."""
    host: str = "127.0.0.1"  # loopback by default: only agents on this machine reach it
    port: int = 8000  # 0 = an ephemeral port
    api_key: str | None = None  # None: the environment variable api_key_env, else a fresh per-run key (printed)
    api_key_env: str = "MTRAIN_API_KEY"
    model_name: str | None = None  # what /v1/models lists and requests name; None = the model folder's name
    tool_parser: Literal["qwen25", "qwen", "hermes"] | None = "qwen25"  # None: requests with tools are refused
    default_max_tokens: int = 512  # a request's budget when it names none (capped by the context left)
    max_concurrency: int = 256  # requests running at once; more get 429
    max_body_kb: int = 4096  # larger request bodies get 413
    # Server-based RL in `mtrain train`: "module:name" of an agent `async (base_url, api_key, sample) -> reward` (or
    # a factory name(model_name) -> agent) run n times per prompt through each engine leader's front (ephemeral
    # loopback port; serve.port is for `mtrain serve`). None = the built-in rollouts.
    agent: str | None = None
    shutdown_grace_s: float = 5.0  # on stop, running calls get this long; streams still open then end with an error
    read_timeout_s: float = 30.0  # a connection that sends no complete request (headers, body) within it is closed
    max_sessions: int = 10000  # open sessions at once; POST /sessions beyond it gets 429
    session_ttl_s: float | None = 3600.0  # `mtrain serve`: a session unused this long is dropped (null = never)
    # tokens one session may record (every branch's full trajectory: prompt, outputs, their logprobs); a call on
    # a session already past it gets 409 session_full (one call may pass it by at most its own output)
    max_session_tokens: int = 4_000_000


@dataclass
class NumericsConfig:
    """How the trainer and the engine compute (docs/design-on-policy.md)."""
    # bitwise: both sides run the fixed-order ops of mtrain/kernels/bitwise_ops.py, so the engine's logprob of each
    # sampled token equals the trainer's recomputed one bit for bit (logprob_diff/* = 0); CPU reference engine only.
    on_policy: Literal["off", "bitwise"] = "off"


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    numerics: NumericsConfig = field(default_factory=NumericsConfig)

    @property
    def rollout_batch_size(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.samples_per_prompt

    @property
    def engine_dtype(self) -> str:
        """What the rollout engines compute in (SGLang's `dtype`): model.dtype unless engine.weight_dtype=bfloat16
        (fp8 engines keep model.dtype for what they do not quantize)."""
        return "bfloat16" if self.engine.weight_dtype == "bfloat16" else self.model.dtype

    def to_dict(self) -> dict[str, Any]:
        """The config as the keys users write, secrets (SECRET_KEYS) set to null: this is what every dump, log
        and tracker (config.yaml, the printed config, W&B) gets. Code that needs a secret reads the field."""
        tree = _user_keys(dataclasses.asdict(self))
        for key in SECRET_KEYS:
            section, name = key.split(".", 1)
            tree[section][name] = None
        return tree

    def format_config(self) -> str:
        """The full resolved config as YAML, for printing at start (secrets left out: a comment says which)."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)
        given = [k for k in SECRET_KEYS if getattr(getattr(self, k.split(".")[0]), k.split(".", 1)[1])]
        notes = "".join(f"# {k}: set, not written here (a secret); give it through {SECRET_KEYS[k]}\n" for k in given)
        return notes + text

    def dump_yaml(self, path: str | os.PathLike) -> Path:
        """Write the full config (loadable by load_config, secrets left out) via a temp file + rename. The folder
        it goes in is made owner-only (0700): a run folder holds checkpoints and logs that sandboxed tool code
        (another uid on this host) must not read."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        replace_text(path, self.format_config())
        return path
