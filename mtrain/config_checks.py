"""Cross-field checks of a run configuration (`mtrain.config.load_config` runs them), and the error every config
problem raises. Apart from mtrain/config.py so that the dataclass tree stays readable; these checks are not
readers of the keys (tests/test_config_readers.py skips this file too)."""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from mtrain.config_error import ConfigError
from mtrain.config_sections import SECRET_KEYS, _key_of  # SECRET_KEYS: from the config file or the environment only
from mtrain.engine_args import server_args_problems
from mtrain.tokenizer_files import TOKENIZER_FILES  # a model dir with none: the char tokenizer of its vocab_size

if TYPE_CHECKING:
    from mtrain.config_sections import RunConfig


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")




def refuse_secret_overrides(overrides) -> None:
    for o in overrides:
        key = o.lstrip("-").split("=", 1)[0].strip()
        value = o.split("=", 1)[1].strip() if "=" in o else ""
        if key in SECRET_KEYS and value not in ("", "null", "~"):
            raise ConfigError(f"{key}: a secret on the command line is readable by every process of this host "
                              f"(/proc/PID/cmdline); give it through {SECRET_KEYS[key]} or the config file")


def _at_least(cfg: RunConfig, lo: float, *keys: str, optional: bool = False) -> None:
    """Simple lower bounds: `section.key >= lo` (or null when optional)."""
    for key in keys:
        section, name = key.split(".", 1)
        obj = getattr(cfg, section)
        for part in name.split(".")[:-1]:
            obj = getattr(obj, part)
        v = getattr(obj, name.split(".")[-1])
        _check((optional and v is None) or (v is not None and v >= lo), key,
               f"must be >= {lo}{' or null' if optional else ''}, got {v}")


def _check_finite(section, prefix: str = "") -> None:
    """Every float key is finite. No key means anything by inf or NaN (null turns off the keys that can be off):
    inf passes every `> 0` check (optim.lr=inf trained to NaN weights, train.collective_timeout_s=inf died in
    timedelta) and NaN passes keys without a range check. Runs after the keys' own checks, which say more."""
    for f in dataclasses.fields(section):
        v, key = getattr(section, f.name), f"{prefix}{_key_of(f.name)}"
        if dataclasses.is_dataclass(v):
            _check_finite(v, f"{key}.")
        elif isinstance(v, float):
            _check(math.isfinite(v), key, f"must be a finite number, got {v}")


def validate(cfg: RunConfig) -> None:
    """Cross-field checks. World-size checks (tp*pp*... divides the ranks) happen where ranks are known."""
    p, e, r, a, o, d, t = (cfg.parallel, cfg.engine, cfg.rollout, cfg.algo, cfg.optim, cfg.data, cfg.train)
    check_critic(cfg)
    check_on_policy(cfg)
    _check(bool(cfg.model.hf_path), "model.hf_path", "is required (a HF model dir with config.json)")
    _at_least(cfg, 1, "parallel.tp", "parallel.pp", "parallel.ep", "parallel.cp", "engine.tp",
              "rollout.prompts_per_step", "rollout.max_new_tokens", "rollout.max_prompt_len", "engine.nnodes",
              "rollout.max_groups_in_flight",
              "data.arithmetic.num_train", "data.arithmetic.max_operand", "train.micro_batch_size",
              "data.longtail.num_train", "data.longtail.median_count", "data.longtail.max_count",
              "train.eval_samples", "sync.bucket_mb")
    _at_least(cfg, 0, "data.longtail.num_eval", "data.longtail.sigma")
    _at_least(cfg, 1, "data.count_shapes.num_train", "data.count_shapes.max_shapes")
    _at_least(cfg, 0, "data.count_shapes.num_eval")
    _at_least(cfg, 28, "data.count_shapes.min_size")  # one 28 x 28 merged token at least
    _check(d.count_shapes.max_size >= d.count_shapes.min_size, "data.count_shapes.max_size",
           f"must be >= data.count_shapes.min_size ({d.count_shapes.min_size}), got {d.count_shapes.max_size}")
    _at_least(cfg, 28 * 28, "data.max_pixels", optional=True)
    _at_least(cfg, 0, "optim.warmup_steps", "optim.weight_decay", "optim.clip_grad", "algo.kl_coef",
              "algo.entropy_coef", "data.arithmetic.num_eval", "train.eval_interval")
    _at_least(cfg, -1, "train.save_interval")
    _at_least(cfg, 1, "train.keep_checkpoints", optional=True)
    _check(t.collective_timeout_s > 0, "train.collective_timeout_s", f"must be > 0, got {t.collective_timeout_s}")
    _at_least(cfg, 1, "parallel.etp", optional=True)
    _at_least(cfg, 2, "parallel.vpp", optional=True)
    _at_least(cfg, 2, "data.arithmetic.num_operands")
    _check(p.vpp is None or p.pp > 1, "parallel.vpp", f"needs parallel.pp > 1 (pp={p.pp})")
    _check(e.weight_dtype in ("auto", "bfloat16", "fp8"), "engine.weight_dtype",
           f"must be auto, bfloat16 or fp8, got {e.weight_dtype!r}")
    _check(e.fp8_scaling in ("auto", "block", "channel"), "engine.fp8_scaling",
           f"must be auto, block or channel, got {e.fp8_scaling!r}")
    _check(e.fp8_scaling == "auto" or e.weight_dtype == "fp8", "engine.fp8_scaling",
           f"{e.fp8_scaling} is an FP8 engine's format: it needs engine.weight_dtype=fp8 (got {e.weight_dtype})")
    _check(0.0 < e.mem_fraction_static < 1.0, "engine.mem_fraction_static",
           f"must be in (0, 1), got {e.mem_fraction_static}")
    args_problems = server_args_problems(e.server_args, e.kind)
    _check(not args_problems, "engine.server_args", "; ".join(args_problems))
    # The critic-free algorithms take a group baseline: one sample per prompt gives advantage 0 everywhere. PPO's
    # advantage is its critic's GAE, and distillation alone (algo.distill.only) the teacher's per-token term: neither
    # needs a group (unless DAPO's filter drops the uniform ones, which every group of one is).
    group = a.name != "ppo" and not (a.distill.only and a.distill.teacher_path and not a.filter_uniform_groups)
    _check(r.samples_per_prompt >= (2 if group else 1), "rollout.samples_per_prompt",
           f"must be >= 2 for {a.name} (the group baseline needs several samples), got {r.samples_per_prompt}"
           if group else f"must be >= 1, got {r.samples_per_prompt}")
    _check(r.temperature > 0, "rollout.temperature",
           f"must be > 0 (greedy rollouts give equal samples and zero advantages), got {r.temperature}")
    _check(0.0 < r.top_p <= 1.0, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    _check(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", f"must be -1 (off) or >= 1, got {r.top_k}")
    _check(all(i >= 0 for i in r.stop_token_ids), "rollout.stop_token_ids", "token ids must be >= 0")
    _check(0.0 < a.clip_eps_low < 1.0, "algo.clip_eps_low", f"must be in (0, 1), got {a.clip_eps_low}")
    _check(a.clip_eps_high > 0.0, "algo.clip_eps_high", f"must be > 0, got {a.clip_eps_high}")
    _check(a.dual_clip_c is None or a.dual_clip_c > 1.0, "algo.dual_clip_c",
           f"must be > 1 or null, got {a.dual_clip_c}")
    _check(a.adv_eps > 0.0, "algo.adv_eps", f"must be > 0, got {a.adv_eps}")
    _check(a.tis_cap is None or a.tis_cap > 0, "algo.tis_cap", f"must be > 0 or null, got {a.tis_cap}")
    check_score_centering(cfg)
    check_shared_prefix(cfg)
    _check(r.over_sample is None or r.over_sample >= 1.0, "rollout.over_sample", f"must be >= 1 (groups in flight "
           f"/ groups trained), got {r.over_sample}")
    _check(r.partial or r.over_sample is None, "rollout.over_sample", "needs rollout.partial=true")
    _check(not r.partial or r.offpolicy != "tis" or a.tis_cap is not None, "rollout.offpolicy",
           "tis needs algo.tis_cap (the cap of the trainer/rollout probability ratio)")
    _check(r.max_staleness is None or r.max_staleness >= 0, "rollout.max_staleness",
           f"must be >= 0 or null, got {r.max_staleness}")
    _check(r.max_new_tokens_start is None or 1 <= r.max_new_tokens_start <= r.max_new_tokens,
           "rollout.max_new_tokens_start", f"must be in [1, rollout.max_new_tokens={r.max_new_tokens}] or null, got "
           f"{r.max_new_tokens_start}")
    _check(r.max_new_tokens_ramp_steps >= 0, "rollout.max_new_tokens_ramp_steps",
           f"must be >= 0, got {r.max_new_tokens_ramp_steps}")
    _check(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
    _check(0 <= o.min_lr <= o.lr, "optim.min_lr", f"must be in [0, optim.lr={o.lr}], got {o.min_lr}")
    for k in ("adam_beta1", "adam_beta2"):
        _check(0.0 <= getattr(o, k) < 1.0, f"optim.{k}", f"must be in [0, 1), got {getattr(o, k)}")
    _check(o.eps > 0, "optim.eps", f"must be > 0, got {o.eps}")
    _check((d.task is None) != (d.train_path is None), "data.train_path",
           "set exactly one of data.train_path and data.task "
           f"(got train_path={d.train_path!r}, task={d.task!r})")
    _check(not (d.task and d.eval_path), "data.eval_path",
           f"a generated task (data.task={d.task!r}) makes its own eval set; unset data.eval_path")
    _check(bool(d.prompt_key) and bool(d.answer_key), "data.prompt_key", "prompt_key/answer_key must be set")
    _check(bool(d.arithmetic.ops) and set(d.arithmetic.ops) <= set("+-*"), "data.arithmetic.ops",
           f"must be a non-empty string of '+', '-', '*', got {d.arithmetic.ops!r}")
    _check(":" in cfg.reward.fn, "reward.fn", f"must look like 'module:function', got {cfg.reward.fn!r}")
    _check(cfg.reward.timeout_s is None or cfg.reward.timeout_s > 0, "reward.timeout_s",
           f"must be > 0 or null, got {cfg.reward.timeout_s}")
    check_judge(cfg)
    _check(t.steps >= 1 or t.val_only, "train.steps", f"must be >= 1, got {t.steps}")
    gbs = t.global_batch_size if t.global_batch_size is not None else cfg.rollout_batch_size
    _check(gbs >= 1 and cfg.rollout_batch_size % gbs == 0, "train.global_batch_size",
           f"must divide the rollout batch (prompts_per_step*samples_per_prompt = {cfg.rollout_batch_size}), "
           f"got {gbs}")
    _check(t.max_tokens_per_micro_batch is not None or gbs % t.micro_batch_size == 0, "train.micro_batch_size",
           f"must divide the global batch size {gbs}, got {t.micro_batch_size}")
    longest = r.max_prompt_len + r.max_new_tokens
    if p.cp > 1:  # context parallelism pads every sequence to a multiple of 2 * cp
        longest = -(-longest // (2 * p.cp)) * 2 * p.cp
    _check(t.max_tokens_per_micro_batch is None or t.max_tokens_per_micro_batch * p.cp >= longest,
           "train.max_tokens_per_micro_batch", f"(tokens per GPU) x parallel.cp={p.cp} must hold the longest sample a "
           f"rollout can make (rollout.max_prompt_len + rollout.max_new_tokens) = {longest}"
           f"{' padded to a multiple of 2*cp' if p.cp > 1 else ''}, got {t.max_tokens_per_micro_batch}")
    if t.eval_interval > 0 or t.val_before_train or t.val_only:
        has_eval = d.eval_path is not None or (d.task == "arithmetic" and d.arithmetic.num_eval > 0) or (
            d.task == "longtail" and d.longtail.num_eval > 0)
        _check(has_eval, "train.eval_interval",
               "evaluation is on (eval_interval/val_before_train/val_only) but there is no eval set: "
               "set data.eval_path, or data.task with data.arithmetic.num_eval > 0")
    _check(not cfg.model.mtp, "model.mtp",
           "training the MTP layers is not supported: the RL loss trains the main model only (set model.mtp=false; "
           "the converted checkpoint keeps the MTP weights)")
    _check(not o.cpu_offload or o.use_distributed_optimizer, "optim.cpu_offload",
           "megatron-core offloads the optimizer only with the distributed optimizer: set "
           "optim.use_distributed_optimizer=true")
    # megatron-core 0.16.1 builds float32 parameters' optimizer shards as views (non-leaf tensors), which its
    # HybridDeviceOptimizer refuses ("can't optimize a non-leaf Tensor"): offload is for bf16 training.
    _check(not o.cpu_offload or cfg.model.dtype == "bfloat16", "optim.cpu_offload",
           f"needs model.dtype=bfloat16 (megatron-core offloads the fp32 master copies of bf16 weights), got "
           f"{cfg.model.dtype}")
    # megatron-core 0.16.1's dp_reshardable load writes the hybrid optimizer's master weights into its state dict
    # only, never into the host copies its CPU Adam steps (fully_reshardable and fully_sharded_model_space call
    # HybridDeviceOptimizer._sync_hdo_state_to_sub_optimizers, dp_reshardable does not): a resume would silently
    # continue from stale master weights.
    _check(not o.cpu_offload or t.optimizer_checkpoint == "fully_reshardable", "train.optimizer_checkpoint",
           "optim.cpu_offload=true resumes correctly only from fully_reshardable optimizer checkpoints (megatron-core "
           "0.16.1's dp_reshardable load does not reach the host master weights): set "
           "train.optimizer_checkpoint=fully_reshardable")
    _at_least(cfg, 1, "train.recompute.num_layers")
    _check(bool(t.run_dir), "train.run_dir", "must not be empty")
    _check(bool(t.resume), "train.resume", "must be 'auto', 'never' or a checkpoint path")
    sv = cfg.serve
    _check(0 <= sv.port <= 65535, "serve.port", f"must be in [0, 65535], got {sv.port}")
    _check(bool(sv.host), "serve.host", "must not be empty")
    _at_least(cfg, 1, "serve.default_max_tokens", "serve.max_concurrency", "serve.max_body_kb", "serve.max_sessions",
              "serve.max_session_tokens")
    _check(sv.api_key is None or bool(sv.api_key.strip()), "serve.api_key",
           f"must not be empty (an empty key would turn authentication off); leave it out (null) to take "
           f"${sv.api_key_env} or a key made for this run")
    # Seconds: finite and at most an hour (an infinite read timeout cannot be scheduled; an infinite grace skips
    # the drain). session_ttl_s may be null (never) or up to 30 days.
    for k, hi in (("shutdown_grace_s", 3600), ("read_timeout_s", 3600), ("session_ttl_s", 30 * 86400)):
        v, lo = getattr(sv, k), (">= 0" if k == "shutdown_grace_s" else "> 0")
        in_range = v is not None and (v >= 0 if k == "shutdown_grace_s" else v > 0) and v <= hi  # NaN: False
        _check(in_range or (v is None and k == "session_ttl_s"), f"serve.{k}",
               f"must be {lo} and <= {hi} seconds{' (or null: never)' if k == 'session_ttl_s' else ''}, got {v}")
    mt = cfg.multi_turn
    _at_least(cfg, 1, "multi_turn.max_turns", "multi_turn.max_total_tokens", "multi_turn.max_tool_calls_per_turn",
              "multi_turn.tool_output_max_chars", "multi_turn.sandbox_cpu_s", "multi_turn.sandbox_memory_mb",
              "multi_turn.sandbox_max_procs", "multi_turn.retrieval_top_k", "multi_turn.sandbox_disk_mb",
              "multi_turn.sandbox_max_files")
    _check(mt.sandbox_network or "python" not in mt.tools or os.geteuid() == 0, "multi_turn.sandbox_network",
           "false (a network namespace per python call) needs root; run as root or set it to true")
    for k in ("tool_timeout_s", "sandbox_wall_s"):
        _check(getattr(mt, k) > 0, f"multi_turn.{k}", f"must be > 0, got {getattr(mt, k)}")
    _check(mt.rollout_fn is None or ":" in mt.rollout_fn, "multi_turn.rollout_fn",
           f"must look like 'module:function' or be null, got {mt.rollout_fn!r}")
    _check(bool(mt.tools), "multi_turn.tools", "must name at least one tool")
    _check(cfg.serve.agent is None or ":" in cfg.serve.agent, "serve.agent",
           f"must look like 'module:name' or be null, got {cfg.serve.agent!r}")
    from mtrain.job_split import check_async
    check_async(cfg)  # engine.placement / engine.ranks / rollout.async (docs/design-async.md)
    _check(cfg.serve.agent is None or not (r.partial or mt.rollout_fn), "serve.agent",
           "agents drive their own turns: use serve.agent without rollout.partial and multi_turn.rollout_fn "
           "(rollout.async=stream keeps long agent runs going across updates)")
    _check(a.routing_replay != "rollout" or cfg.parallel.cp == 1 or cfg.train.max_tokens_per_micro_batch is not None,
           "algo.routing_replay", "replaying the engine's routing under context parallelism (parallel.cp > 1) needs "
           "packed micro-batches: set train.max_tokens_per_micro_batch (padded CP rows are not mapped yet)")
    _check_distill(cfg)
    _check_lora(cfg)
    _check(not cfg.sync.delta or cfg.engine.placement == "separate", "sync.delta",
           "applies to engine.placement=separate (weights sent to engines on other ranks); colocated engines read "
           "the trainer's memory, where nothing travels: set sync.delta=false or engine.placement=separate")
    _check_finite(cfg)


def _check_distill(cfg: RunConfig) -> None:
    dc = cfg.algo.distill
    for key in ("coef", "only"):
        _check(bool(dc.teacher_path) or getattr(dc, key) is None, f"algo.distill.{key}",
               "is set but algo.distill.teacher_path is not (distillation needs a teacher model)")
    _check(dc.coef is None or dc.coef > 0, "algo.distill.coef", f"must be > 0, got {dc.coef}")


# The names model.lora.targets may use: the layout tables' keys of each adaptable linear (mtrain/layouts/lora.py
# maps them onto every architecture's rows).
LORA_TARGETS = ("qkv", "o_proj", "gate_up", "down", "experts", "shared.gate_up", "shared.down")


def lora_live_versions(cfg: RunConfig) -> int:
    """How many adapter versions requests may name at once: 2 (the new one, the old one's last requests), and under
    stream max_staleness + 1 (a batch started on version s - K keeps that adapter until it ends, at most K syncs
    later; null = 1, trainer/sources/stream.py STREAM_STALENESS)."""
    if cfg.rollout.async_mode != "stream":
        return 2
    return max(2, (cfg.rollout.max_staleness if cfg.rollout.max_staleness is not None else 1) + 1)


def _check_lora(cfg: RunConfig) -> None:
    """model.lora: its own bounds, and the combinations LoRA does not run with (model-dependent checks, such as
    targets that match no layer, run where the model's config is read: mtrain.models.lora.check_model)."""
    lo, e = cfg.model.lora, cfg.engine
    _check(lo.rank > 0, "model.lora.rank", f"must be > 0, got {lo.rank}")
    _check(lo.alpha > 0, "model.lora.alpha", f"must be > 0, got {lo.alpha}")
    _check(0 <= lo.dropout < 1, "model.lora.dropout", f"must be in [0, 1), got {lo.dropout}")
    _check(lo.lr is None or lo.lr > 0, "model.lora.lr", f"must be > 0 or null, got {lo.lr}")
    bad = [t for t in lo.targets if t not in LORA_TARGETS]
    _check(not bad, "model.lora.targets", f"unknown target(s) {bad}; the layout tables name {', '.join(LORA_TARGETS)}")
    if not lo.targets:
        return
    _check(len(set(lo.targets)) == len(lo.targets), "model.lora.targets", f"names a target twice: {lo.targets}")
    max_rank = e.server_args.get("max_lora_rank")
    _check(max_rank is None or lo.rank <= int(max_rank), "model.lora.rank",
           f"{lo.rank} is above the engine's max_lora_rank ({max_rank}, engine.server_args.max_lora_rank)")
    slots, live = e.server_args.get("max_loras_per_batch"), lora_live_versions(cfg)
    why = ("a LoRA sync needs 2 pool slots (the new adapter version, and the previous one while its requests "
           "finish; mtrain/rollout/lora_adapters.py)") if cfg.rollout.async_mode != "stream" else (
        f"rollout.async=stream with max_staleness {live - 1} keeps up to {live} adapter versions in one batch "
        f"(requests keep the adapter they started on); set it >= {live}")
    _check(e.kind != "sglang" or slots is None or int(slots) >= live, "engine.server_args.max_loras_per_batch",
           f"{slots}: {why}")


def check_on_policy(cfg: RunConfig) -> None:
    """numerics.on_policy=bitwise: refuse, in one line, what cannot be bit for bit (docs/design-on-policy.md)."""
    if cfg.numerics.on_policy != "bitwise":
        return
    key, e = "numerics.on_policy", cfg.engine
    import torch  # only in this mode: engine.kind=auto means SGLang where a GPU is
    sglang = e.kind == "sglang" or (e.kind == "auto" and torch.cuda.is_available())
    _check(e.weight_dtype == "auto", key, f"bitwise needs the engine to hold the trainer's dtype (engine.weight_dtype="
           f"auto), got {e.weight_dtype}")
    _check(e.tp == 1, key, f"bitwise engines run at engine.tp=1 (the reference engine has no TP; on SGLang the "
           f"row-parallel sums would be the all-reduce's); got engine.tp={e.tp}")
    # The CPU ops add a row-parallel layer's ranks by the same fixed tree as one rank; the GPU linear adds K in
    # ascending chunks into one accumulator, which a split over ranks cannot reproduce (docs/design-on-policy.md).
    _check(not sglang or cfg.parallel.tp == 1, key, f"bitwise on SGLang needs parallel.tp=1 (the GPU kernel's K order "
           f"cannot be split over ranks); got parallel.tp={cfg.parallel.tp}")
    _check(not sglang or not cfg.model.train_vision, key, "bitwise on SGLang serves text models (Llama, Qwen3)")
    _check(not cfg.model.lora.targets, key, "bitwise is not built for LoRA adapters")
    _check(cfg.algo.routing_replay == "off", key, "bitwise computes the same routes on both sides (no replay): "
           "algo.routing_replay must be off")
    _check(cfg.parallel.ep == 1, key, f"bitwise is not built for expert parallelism: EP ranks hold different tokens, "
           f"which its MoE layer computes locally without a dispatcher; got parallel.ep={cfg.parallel.ep}")
    _check(cfg.parallel.cp == 1 and cfg.parallel.pp == 1, key,
           f"bitwise is built for tensor parallelism only (parallel.pp=1, parallel.cp=1), got pp={cfg.parallel.pp} "
           f"cp={cfg.parallel.cp}")
    _check(not cfg.model.fp32_lm_head, key, "bitwise computes the head its own way: model.fp32_lm_head must be false")
    _check(not cfg.train.shared_prefix, key, "bitwise is not built for shared-prefix (tree) attention")


def check_paths(cfg: RunConfig) -> None:
    """Filesystem checks, separate from validate() so a config can be checked on another machine:
    the HF dir holds config.json; data files and the Megatron checkpoint exist."""
    hf = Path(cfg.model.hf_path)
    _check((hf / "config.json").is_file(), "model.hf_path", f"{hf} is not a HF model dir (no config.json)")
    _check(cfg.model.mcore_ckpt is None or Path(cfg.model.mcore_ckpt).exists(), "model.mcore_ckpt",
           f"{cfg.model.mcore_ckpt} does not exist")
    if cfg.algo.distill.teacher_path:
        check_teacher(hf, Path(cfg.algo.distill.teacher_path))
    for key in ("train_path", "eval_path"):
        path = getattr(cfg.data, key)
        _check(path is None or Path(path).is_file() or Path(path).is_dir(), f"data.{key}",
               f"{path} is not a file or a dataset folder")


def read_config_json(model_dir: Path, key: str) -> dict:
    """A model dir's config.json as a dict; unreadable or not an object is one line naming `key`."""
    import json
    path = Path(model_dir) / "config.json"
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {path} is unreadable: {e}") from None
    _check(isinstance(out, dict), key, f"{path} must hold a JSON object")
    return out


def _vocab_size(model_dir: Path, key: str) -> int:
    c = read_config_json(model_dir, key)
    v = c.get("vocab_size", (c.get("text_config") or {}).get("vocab_size"))
    _check(isinstance(v, int), key, f"{Path(model_dir) / 'config.json'} has no vocab_size")
    return v


def check_teacher(policy: Path, teacher: Path) -> None:
    """The teacher scores the student's token ids: its vocabulary and tokenizer must be the policy's."""
    key = "algo.distill.teacher_path"
    _check((teacher / "config.json").is_file(), key, f"{teacher} is not a HF model dir (no config.json)")
    pv, tv = _vocab_size(policy, "model.hf_path"), _vocab_size(teacher, key)
    _check(pv == tv, key, f"the teacher's vocab_size is {tv}, the policy's ({policy}) is {pv}: distillation "
           f"compares the two models' logprobs of the same token ids")
    p_files = sorted(f for f in TOKENIZER_FILES if (policy / f).exists())
    t_files = sorted(f for f in TOKENIZER_FILES if (teacher / f).exists())
    _check(bool(p_files) == bool(t_files), key, f"the policy's tokenizer files are {p_files or 'none'}, the "
           f"teacher's {t_files or 'none'}: the two models must share one tokenizer")
    if not p_files:
        return  # both use the character tokenizer of the same vocab_size
    from transformers import AutoTokenizer
    pt, tt = AutoTokenizer.from_pretrained(str(policy)), AutoTokenizer.from_pretrained(str(teacher))
    p_vocab, t_vocab = pt.get_vocab(), tt.get_vocab()
    diff = sorted(set(p_vocab.items()) ^ set(t_vocab.items()), key=lambda kv: kv[1])
    _check(not diff, key, f"the teacher's tokenizer differs from the policy's: {len(diff)} (token, id) pairs are in "
           f"one vocabulary only, e.g. {diff[:1]}")
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
        _check(getattr(pt, attr) == getattr(tt, attr), key, f"the teacher's tokenizer has {attr}="
               f"{getattr(tt, attr)}, the policy's {getattr(pt, attr)}")


def check_critic(cfg: RunConfig) -> None:
    """PPO's critic keys only with algo.name=ppo, which ignores the group-baseline options
    (docs/design-critic-distill.md)."""
    import dataclasses
    a, c = cfg.algo, cfg.critic
    if a.baseline == "leave_one_out":
        _check(a.name != "ppo", "algo.baseline", "leave_one_out is a critic-free baseline; algo.name=ppo estimates "
               "advantages with its critic (GAE): use algo.baseline=group_mean")
        _check(a.adv_norm in ("group_std", "none"), "algo.baseline",
               f"leave_one_out with algo.adv_norm={a.adv_norm!r}: it takes group_std or none (batch_std is "
               "REINFORCE++'s own group-mean baseline)")
        _check(cfg.rollout.samples_per_prompt >= 2, "algo.baseline",
               "leave_one_out needs rollout.samples_per_prompt >= 2 (a sample's baseline is its group's others)")
    if a.name == "ppo":
        _check(a.adv_norm in ("batch_std", "none"), "algo.adv_norm",
               f"algo.name=ppo whitens GAE advantages over the batch (batch_std) or not (none), got {a.adv_norm!r} "
               "(a group baseline is GRPO's)")
        _check(not a.filter_uniform_groups, "algo.filter_uniform_groups",
               "algo.name=ppo has a critic, not a group baseline: uniform groups still train it; set it false")
        _check(cfg.parallel.cp == 1, "parallel.cp", "the critic does not run under context parallelism yet (cp=1)")
        _check(not a.distill.only, "algo.distill.only", "with algo.name=ppo the distillation term is added to the "
               "critic's GAE advantage; distillation alone needs no critic: use a critic-free algo.name")
        _check(c.lr > 0, "critic.lr", f"must be > 0, got {c.lr}")
        _check(c.warmup_steps >= 0, "critic.warmup_steps", f"must be >= 0, got {c.warmup_steps}")
        _check(c.value_clip > 0, "critic.value_clip", f"must be > 0, got {c.value_clip}")
        for k in ("gamma", "lam"):
            _check(0.0 <= getattr(c, k) <= 1.0, f"critic.{k}", f"must be in [0, 1], got {getattr(c, k)}")
    else:
        for f in dataclasses.fields(c):
            k = f.name
            _check(getattr(c, k) == f.default, f"critic.{k}",
                   f"is set but algo.name={a.name} has no critic (critic.* is read by algo.name=ppo only)")


def check_score_centering(cfg: RunConfig) -> None:
    """algo.score_centering (docs/design-score-centering.md): the head the engines record and what it can correct."""
    a, r = cfg.algo, cfg.rollout
    _check(isinstance(a.score_centering, bool), "algo.score_centering", f"must be true or false, got {a.score_centering!r}")
    _check(isinstance(a.score_centering_k, int) and not isinstance(a.score_centering_k, bool)
           and 1 <= a.score_centering_k <= MAX_SCORE_CENTERING_K, "algo.score_centering_k",
           f"must be an int in [1, {MAX_SCORE_CENTERING_K}] (the sampler's top-k logprobs per token), "
           f"got {a.score_centering_k!r}")
    if not a.score_centering:
        return
    _check(r.top_p == 1.0 and r.top_k == -1, "algo.score_centering",
           f"needs untruncated sampling (rollout.top_p=1, rollout.top_k=-1; got {r.top_p}, {r.top_k}): the "
           f"recorded-support variant for top-p/top-k sampling is not built")
    _check(r.temperature > 0, "algo.score_centering", "needs sampling (rollout.temperature > 0), not greedy decoding")
    _check(cfg.parallel.cp == 1, "algo.score_centering", "is not supported with context parallelism "
           f"(parallel.cp={cfg.parallel.cp}) yet")


MAX_SCORE_CENTERING_K = 1024


def check_shared_prefix(cfg: RunConfig) -> None:
    """train.shared_prefix (docs/design-shared-prefix.md): a packed stream with per-token positions."""
    t = cfg.train
    _check(isinstance(t.shared_prefix, bool), "train.shared_prefix", f"must be true or false, got {t.shared_prefix!r}")
    if not t.shared_prefix:
        return
    _check(t.max_tokens_per_micro_batch is not None, "train.shared_prefix",
           "needs packed micro-batches (set train.max_tokens_per_micro_batch)")
    _check(cfg.parallel.cp == 1, "train.shared_prefix", f"is not supported with context parallelism "
           f"(parallel.cp={cfg.parallel.cp})")


def check_judge(cfg: RunConfig) -> None:
    """reward.judge (mtrain/rollout/judge.py): a model that exists, a template that shows the judge the response, a
    parser that can be built, bounds that make sense; all said before any engine starts."""
    import re

    j = cfg.reward.judge
    if j.hf_path is None:
        return
    _check(bool(j.hf_path), "reward.judge.hf_path", "is empty: the judge's HF model dir, or null for no judge")
    _check((Path(j.hf_path) / "config.json").is_file(), "reward.judge.hf_path",
           f"{j.hf_path!r} is not a HF model dir (no config.json there)")
    _check("{response}" in j.template, "reward.judge.template",
           "must contain {response} (the judge must see the answer it judges); {prompt} and {answer} are optional")
    for k in ("timeout_s", "score_max"):
        v = getattr(j, k)
        _check(isinstance(v, (int, float)) and math.isfinite(v) and v > 0, f"reward.judge.{k}",
               f"must be a finite number > 0, got {v!r}")
    for k in ("batch_size", "max_new_tokens", "max_prompt_len"):
        _check(getattr(j, k) >= 1, f"reward.judge.{k}", f"must be >= 1, got {getattr(j, k)}")
    _check(0 < j.mem_fraction_static < 1, "reward.judge.mem_fraction_static",
           f"must be in (0, 1), got {j.mem_fraction_static}")
    if j.parser == "regex":
        _check(bool(j.pattern), "reward.judge.pattern", "parser=regex needs a pattern with one group")
        try:
            groups = re.compile(j.pattern).groups
        except re.error as e:
            raise ConfigError(f"reward.judge.pattern: {j.pattern!r} is not a valid regular expression: {e}") from None
        _check(groups == 1, "reward.judge.pattern", f"{j.pattern!r} has {groups} groups; it needs exactly one")
    else:
        _check(j.pattern is None, "reward.judge.pattern", f"is read by parser=regex only (parser={j.parser!r})")
