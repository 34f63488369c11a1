"""Checks before any process group starts: everything knowable from the config, the world size and the files.

`mtrain train` calls `preflight(cfg)` on every rank before `init_distributed`, so a wrong path, a model that does
not fit the parallel layout, a batch that does not split over the data-parallel ranks and micro batches, or a
damaged checkpoint is one line and exit 2 within a second or two — not a traceback per rank after the first
rollout. The weight checks are the converters' own (`mtrain.converters.mcore_io`): what `mtrain-convert` rejects,
`mtrain train` rejects too, with the same words.

Every failure is a ConfigError whose message starts with the config key to change.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from mtrain.config import ConfigError, RunConfig, check_paths
from mtrain.memory_plan import report as report_memory_plan


def _fail(key: str, msg: str) -> ConfigError:
    return ConfigError(f"{key}: {msg}")


def read_hf_config(cfg: RunConfig) -> dict:
    from mtrain.config_checks import read_config_json
    return read_config_json(Path(cfg.model.hf_path), "model.hf_path")


def world_size() -> int:
    """torchrun's WORLD_SIZE (1 without torchrun, as init_distributed assumes)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def data_parallel_size(cfg: RunConfig, world: int) -> int:
    from mtrain.dist import ParallelLayoutError, _sizes
    p = cfg.parallel
    try:
        dp, _, _ = _sizes(world, p.tp, p.pp, p.ep, p.etp, p.cp)
    except ParallelLayoutError as e:
        raise _fail("parallel", f"{e} (torchrun --nproc-per-node x nodes = {world})") from None
    return dp


def check_batch(cfg: RunConfig, dp: int) -> None:
    """Each optimizer step's samples split evenly over the data-parallel ranks, then into micro batches."""
    t = cfg.train
    rollout = cfg.rollout_batch_size
    gbs = t.global_batch_size or rollout
    per_rank, unit = gbs // dp, dp * t.micro_batch_size
    what = ("rollout.prompts_per_step x rollout.samples_per_prompt = "
            f"{cfg.rollout.prompts_per_step} x {cfg.rollout.samples_per_prompt} = {rollout}"
            if t.global_batch_size is None else f"train.global_batch_size = {gbs}")
    if gbs % unit:
        raise _fail("train.micro_batch_size",
                    f"{what} samples per optimizer step do not split over {dp} data-parallel rank(s) x micro batches "
                    f"of {t.micro_batch_size}: it must be a multiple of {unit}"
                    + (f" ({per_rank} samples per rank)" if gbs % dp == 0 else ""))


def check_rollout_host_memory(cfg: RunConfig) -> None:
    """A step's rollout batch cannot outgrow the host: every completion of the step is held at once, at least
    MIN_COMPLETION_HOST_BYTES each. Past this floor a huge rollout.prompts_per_step (10**9) was minutes of the
    sampler filling memory, then a MemoryError traceback or the OOM killer; a batch larger than the data set is
    fine (it goes on into the next epoch), so only the host's memory bounds it here."""
    from mtrain.rollout.protocol import MIN_COMPLETION_HOST_BYTES
    r = cfg.rollout
    samples = math.ceil(r.prompts_per_step * (r.over_sample if r.partial else 1.0)) * r.samples_per_prompt
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if samples * MIN_COMPLETION_HOST_BYTES > host:
        gib = 1 << 30
        held = f"{samples} samples per step" + (f" with rollout.over_sample={r.over_sample}" if r.partial else "")
        raise _fail("rollout.prompts_per_step", f"{r.prompts_per_step} x rollout.samples_per_prompt="
                    f"{r.samples_per_prompt}: {held} hold at least {samples * MIN_COMPLETION_HOST_BYTES / gib:.0f} GiB "
                    f"of host memory ({MIN_COMPLETION_HOST_BYTES} bytes per completion), more than this host's "
                    f"{host / gib:.0f} GiB: lower rollout.prompts_per_step")


def check_model(cfg: RunConfig, hf_config: dict, dp: int) -> None:
    """The model's config.json is one we build, and its heads/groups/layers/experts fit the parallel sizes
    (the layout the trainer will build: vpp and an uneven pipeline split included), planned as the sync plans it."""
    from mtrain.converters.errors import ConvertError
    from mtrain.converters.mcore_io import layout_for
    from mtrain.layouts import LayoutError
    from mtrain.models.hf_config import ModelConfigError, map_hf_config
    from mtrain.reshard.placement import HFLayout, MegatronLayout
    from mtrain.reshard.planner import build_plan
    p = cfg.parallel
    try:
        map_hf_config(hf_config)  # names a missing required field; the layout tables below would raise KeyError
        model = layout_for(hf_config, mtp=False)
    except (ConvertError, ModelConfigError) as e:
        raise _fail("model.hf_path", str(e)) from None
    layout = MegatronLayout(tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=p.etp, cp=p.cp, dp=dp,
                            first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers)
    try:
        build_plan(model, HFLayout(), layout)
    except LayoutError as e:
        raise _fail("parallel", f"tp={p.tp} pp={p.pp} ep={p.ep} etp={layout.expert_tp} cp={p.cp} (dp={dp}) do "
                                f"not fit the model: {e}") from None
    check_moe_tensor_parallel(cfg, hf_config)
    e = cfg.engine
    if _engine_is_sglang(cfg):  # SGLang's own sharding of heads, experts, vocab
        from mtrain.reshard.placement import SGLangLayout
        if model.meta.get("sglang_unsupported"):  # a model SGLang builds otherwise, whatever its sharding
            raise _fail("model.hf_path", f"{model.meta['sglang_unsupported']}; engine.kind=reference computes it")
        try:
            build_plan(model, MegatronLayout(), SGLangLayout(e.tp, e.ep), colocate=lambda r: 0)
        except LayoutError as err:
            raise _fail("engine.tp", f"engine tp={e.tp} ep={e.ep} does not fit the model: {err}") from None
    from mtrain.models.hf_config import context_length
    max_pos = context_length(hf_config)
    if max_pos is not None and cfg.rollout.max_new_tokens >= max_pos:
        raise _fail("rollout.max_new_tokens", f"{cfg.rollout.max_new_tokens} leaves no room for a prompt in the "
                                              f"model's context (max_position_embeddings={max_pos})")


def check_bitwise_model(cfg: RunConfig, hf_config: dict) -> None:
    """numerics.on_policy=bitwise: both sides compute the model with the fixed-order ops, the trainer's bitwise
    layers (mtrain/models/bitwise_layers.bitwise_mapped says what they build) and the engine's forward (the reference
    engine's list, or the SGLang classes mtrain serves). Said here in one line; without it an architecture they do
    not compute (MLA, RoPE scaling, a MoE other than Qwen3-MoE's) was a ValueError traceback per rank once the
    process groups had started."""
    if cfg.numerics.on_policy != "bitwise":
        return
    from mtrain.models.bitwise_layers import bitwise_mapped
    from mtrain.models.hf_config import map_hf_config
    try:
        bitwise_mapped(map_hf_config(hf_config))  # check_model has run: the mapping succeeds
    except ValueError as e:
        raise _fail("numerics.on_policy", f"{e}; use numerics.on_policy=off") from None
    check_bitwise_tensor_parallel(cfg, hf_config)
    if _engine_is_sglang(cfg):
        from mtrain.rollout.protocol import EngineError
        from mtrain.rollout.sglang_wire import bitwise_architecture
        try:
            bitwise_architecture((hf_config.get("architectures") or [""])[0])
        except EngineError as e:
            raise _fail("numerics.on_policy", str(e)) from None
        return
    from mtrain.rollout.reference_engine_bitwise import unsupported_model
    problem = unsupported_model(hf_config)
    if problem:
        raise _fail("numerics.on_policy", problem)


def check_bitwise_tensor_parallel(cfg: RunConfig, hf_config: dict) -> None:
    """numerics.on_policy=bitwise at parallel.tp > 1 adds a row-parallel layer's ranks by a fixed tree, which needs
    each rank's input slice to be a power of two (mtrain/models/bitwise_layers.py refuses it while building the
    model, after the process groups start). Checked here for the layers every such model has: the attention output
    (heads x head_dim), the dense layers' down projection (a MoE model's dense layers too: Qwen3-MoE's
    mlp_only_layers) and the experts' (expert TP is the TP)."""
    from mtrain.layouts.models import moe_layer_pattern
    from mtrain.models.hf_config import map_hf_config
    tp = cfg.parallel.tp
    if cfg.numerics.on_policy != "bitwise" or tp == 1:
        return
    kw = map_hf_config(hf_config).config_kwargs  # check_model has run: the mapping succeeds
    pattern = moe_layer_pattern(hf_config)  # 1: a MoE layer, 0: a dense one
    inputs = {"num_attention_heads x head_dim": kw.get("num_attention_heads", 0) * (kw.get("kv_channels") or 0),
              "intermediate_size": kw.get("ffn_hidden_size", 0) if 0 in pattern else 0,
              "moe_intermediate_size": (kw.get("moe_ffn_hidden_size") or 0) if 1 in pattern else 0}
    from mtrain.kernels.bitwise_ops import row_parallel_slice_problem
    for name, size in inputs.items():  # 0: not this model's layer (MLA attention), left to the build
        problem = row_parallel_slice_problem(size, tp)
        if problem:
            raise _fail("numerics.on_policy", f"bitwise at parallel.tp={tp}: {problem} (this model's {name}={size}): "
                                              f"use parallel.tp=1 or numerics.on_policy=off")


def check_score_centering_k(cfg: RunConfig) -> None:
    """The engines record each token's top score_centering_k logprobs over the vocabulary: a k beyond it was
    torch.topk's "selected index k out of range" in every engine at the first rollout."""
    from mtrain.config_checks import _vocab_size
    a = cfg.algo
    vocab = _vocab_size(Path(cfg.model.hf_path), "model.hf_path") if a.score_centering else None
    if vocab is not None and a.score_centering_k > vocab:
        raise _fail("algo.score_centering_k", f"{a.score_centering_k} is more than the model's vocabulary "
                                              f"(vocab_size={vocab}); set algo.score_centering_k <= {vocab}")


def check_moe_tensor_parallel(cfg: RunConfig, hf_config: dict) -> None:
    """megatron-core 0.16.1 trains MoE with TP > 1 only with sequence parallelism, and its local (non-TE) norms
    refuse sequence parallelism: without Transformer Engine (or with it switched off) a MoE model cannot train at
    parallel.tp > 1, with or without context parallelism. Said here, before any process group starts (the Actor
    says it again for callers that skip preflight)."""
    from mtrain.compat.no_te import te_installed
    from mtrain.models.hf_config import ModelConfigError, map_hf_config
    p = cfg.parallel
    # numerics.on_policy=bitwise: its MoE layer computes every token on every TP rank without megatron-core's
    # dispatcher (mtrain/models/bitwise_moe.py), so TP needs no sequence parallelism there
    if p.tp == 1 or cfg.numerics.on_policy == "bitwise":
        return
    try:
        experts = map_hf_config(hf_config).config_kwargs.get("num_moe_experts")
    except ModelConfigError:
        return  # check_model names the unsupported model
    sp = p.sequence_parallel if p.sequence_parallel is not None else te_installed()
    if experts and not (sp and te_installed()):
        why = "Transformer Engine is not importable here" if not te_installed() else "parallel.sequence_parallel=false"
        raise _fail("parallel.tp", f"{p.tp} with a MoE model ({experts} experts) trains only with sequence "
                                   f"parallelism, and {why}: use parallel.tp=1 with parallel.ep (and parallel.cp "
                                   f"for long samples)")


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _engine_is_sglang(cfg: RunConfig) -> bool:
    """engine.kind as the run will resolve it (one rule: mtrain/trainer/decisions.engine_kind)."""
    from mtrain.trainer.decisions import engine_kind
    return engine_kind(cfg.engine, _cuda()) == "sglang"


def check_sglang_engine(cfg: RunConfig, hf_config: dict) -> None:
    """What an SGLang engine would die of at start or at its first request, said before any process starts."""
    if not _engine_is_sglang(cfg):
        return
    from mtrain.rollout.sglang_preflight import missing_model_keys
    for problem in missing_model_keys(hf_config):
        raise _fail("model.hf_path", f"{cfg.model.hf_path}: {problem}")
    if cfg.engine_dtype == "float32":
        raise _fail("model.dtype", "float32 with an SGLang engine: SGLang's RMSNorm kernel has no float32 path "
                                   "(it fails at the first request); use engine.weight_dtype=bfloat16 (a bf16 engine "
                                   "under the float32 trainer) or model.dtype=bfloat16 (the optimizer keeps float32 "
                                   "main weights)")
    bs = cfg.engine.cuda_graph_max_bs
    if bs is not None and bs < 1:
        raise _fail("engine.cuda_graph_max_bs", f"{bs}: the largest captured decode batch must be at least 1 "
                                                f"(or null: the rollout's own concurrency)")


def check_weights(cfg: RunConfig) -> None:
    """The weights the run starts from are complete: the same checks the converters make on their input. The
    critic's and the teacher's too (their loaders fail the same way, only later: once every rank built a model)."""
    from mtrain.converters.errors import ConvertError
    from mtrain.converters.mcore_io import check_dist_checkpoint
    if cfg.model.mcore_ckpt:
        try:
            check_dist_checkpoint(cfg.model.mcore_ckpt, need_config=False)
        except ConvertError as e:
            raise _fail("model.mcore_ckpt", str(e)) from None
    else:
        _check_hf_weights("model.hf_path", cfg.model.hf_path)
    if cfg.algo.name == "ppo" and cfg.critic.hf_path is not None:
        _check_hf_weights("critic.hf_path", cfg.critic.hf_path)
    if cfg.algo.distill.teacher_path:
        _check_hf_weights("algo.distill.teacher_path", cfg.algo.distill.teacher_path)


def _check_hf_weights(key: str, hf_path: str) -> None:
    from mtrain.converters.errors import ConvertError
    from mtrain.converters.hf_to_mcore import hf_getters
    from mtrain.converters.mcore_io import check_against_table, hf_has_mtp, layout_for
    from mtrain.converters.safetensors_io import HFCheckpoint
    import torch
    try:
        ckpt = HFCheckpoint(hf_path)
        names = list(hf_getters(ckpt, torch.float32))  # FP8 checkpoints: the dequantised view's names
        model = layout_for(ckpt.config, hf_has_mtp(ckpt.config, names))
        check_against_table(model, {n: ckpt.shape(n) for n in names}, {n: ckpt.dtype(n) for n in names}, str(hf_path))
    except ConvertError as e:
        raise _fail(key, str(e)) from None


def check_run_dir(cfg: RunConfig) -> None:
    """train.run_dir is a folder or can be made one: the trainer makes it after the models are built, where a file
    in its place (or above it) was a traceback."""
    from mtrain.paths import nearest_existing
    existing = nearest_existing(cfg.train.run_dir)
    if not existing.is_dir():
        raise _fail("train.run_dir", f"{existing} is a file, not a folder: pick another train.run_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _fail("train.run_dir", f"{existing} is not writable here: pick another train.run_dir")
    import tempfile
    try:  # os.access says yes to root everywhere: a read-only mount, /proc, a full quota say no only when tried
        os.rmdir(tempfile.mkdtemp(prefix=".mtrain_write_probe_", dir=existing))
    except OSError as e:
        raise _fail("train.run_dir", f"cannot make a folder in {existing} ({e.strerror}): pick another "
                                     f"train.run_dir") from None


def check_resume(cfg: RunConfig) -> None:
    """An explicit train.resume path must be a complete, intact checkpoint (auto falls back by itself); no configured
    path may lie in what the start moves aside (mtrain/trainer/run_dir.py)."""
    r = cfg.train.resume
    if r not in ("auto", "never"):
        from mtrain.trainer.checkpoint import checkpoint_problem
        problem = checkpoint_problem(Path(r))
        if problem:
            raise _fail("train.resume", problem)
    from mtrain.trainer.run_dir import moved_config_path
    problem = moved_config_path(cfg)  # a configured path in what the start moves aside
    if problem:
        raise ConfigError(problem)


def check_data(cfg: RunConfig) -> None:
    """Prompt files parse and hold the configured keys (read again by the trainer: they are small next to a model)."""
    from mtrain.data import load_datasets
    from mtrain.data.datasets import DatasetError
    try:
        load_datasets(cfg)
    except DatasetError as e:
        raise _fail(e.key if cfg.data.train_path else "data", str(e)) from None


def check_prompt_context(cfg: RunConfig, hf_config: dict, tokenizer) -> None:
    """Every prompt takes rollout.max_new_tokens more within the model's context: the rollout refuses one that does not
    (data/chat.context_problem) when it is drawn, steps into the run. Nothing is read when rollout.max_prompt_len +
    rollout.max_new_tokens fits (every prompt kept is at most max_prompt_len long); else the prompts are rendered
    here as the rollout renders them, and the first that does not fit is named by its file and line. Single-turn
    generation only: tool and agent rollouts fit their turns into the context themselves. tokenizer: a call that
    returns the model's tokenizer (preflight's, loaded once)."""
    from mtrain.models.hf_config import context_length
    r, d = cfg.rollout, cfg.data
    context = context_length(hf_config)
    if context is None or r.max_prompt_len + r.max_new_tokens <= context or cfg.multi_turn.rollout_fn or \
            cfg.serve.agent:
        return
    from mtrain.data import load_datasets
    from mtrain.data.chat import PromptError, context_problem, tokenize_prompts
    train, evals = load_datasets(cfg)
    for key, samples in (("data.train_path", train), ("data.eval_path", evals)):
        if not samples:
            continue
        try:
            prompts = tokenize_prompts(samples, tokenizer(), max_prompt_len=r.max_prompt_len,
                                       apply_chat_template=d.apply_chat_template, system_prompt=d.system_prompt,
                                       drop_overlong=d.drop_overlong_prompts)
        except PromptError as e:  # the message names the prompt and the setting to change
            raise _fail("data.task" if d.task else key, str(e)) from None
        for p in prompts:
            problem = context_problem(p, r.max_new_tokens, context)
            if problem:
                raise _fail("rollout.max_new_tokens", problem)


def check_reward_package(cfg: RunConfig) -> None:
    """The verifier rewards' optional package, named before start (else the first reward call would fail)."""
    import importlib.util
    if cfg.reward.fn.endswith(":math_verify_reward") and importlib.util.find_spec("math_verify") is None:
        raise _fail("reward.fn", f"{cfg.reward.fn} needs math-verify, which is not installed: "
                                 "pip install 'mtrain[math]'")


def check_logging(cfg: RunConfig) -> None:
    if cfg.train.log_wandb:
        import importlib.util
        if importlib.util.find_spec("wandb") is None:
            raise _fail("train.log_wandb", "true, but wandb is not installed: pip install 'mtrain[wandb]'")
    if cfg.train.log_tensorboard:
        import importlib.util
        if importlib.util.find_spec("torch.utils.tensorboard") is None or \
                importlib.util.find_spec("tensorboard") is None:
            raise _fail("train.log_tensorboard", "true, but TensorBoard is not installed: pip install tensorboard "
                                                 "(or leave the key unset: TensorBoard is then used when installed)")


def check_lora_model(cfg, hf_config: dict) -> None:
    from mtrain.lora_checks import check_model as lora_check
    lora_check(cfg, hf_config)


def preflight(cfg: RunConfig, world: int | None = None) -> dict:
    """Run every check; returns the model's config.json. Raises ConfigError (one line) on the first problem."""
    world = world_size() if world is None else world
    from mtrain.preflight_models import check_tokenizer, resolve_model_sources
    resolve_model_sources(cfg)  # hub ids (ORG/NAME) -> huggingface_hub's cached folder, downloaded once
    check_paths(cfg)
    hf_config = read_hf_config(cfg)
    check_tokenizer(cfg)  # a real model without tokenizer files is refused, not trained through the char tokenizer
    from mtrain.job_split import split_ranks, train_world
    split_ranks(cfg, world)  # engine.placement / engine.ranks fit the world: before any process group
    dp = data_parallel_size(cfg, train_world(cfg, world))
    check_model(cfg, hf_config, dp)
    check_score_centering_k(cfg)
    check_bitwise_model(cfg, hf_config)
    from mtrain.preflight_models import check_side_models
    check_side_models(cfg, hf_config, dp)  # PPO's critic and the distillation teacher fit the layout
    check_lora_model(cfg, hf_config)
    check_sglang_engine(cfg, hf_config)
    check_batch(cfg, dp)
    check_rollout_host_memory(cfg)
    report_memory_plan(cfg, hf_config, dp)  # each GPU's peak, printed; refused in one line if it cannot fit
    check_weights(cfg)
    check_data(cfg)
    from mtrain.preflight_models import check_chat_template, tokenizer_loader
    tokenizer = tokenizer_loader(cfg, hf_config)  # loaded once, by the first check that needs it
    check_chat_template(cfg, hf_config, tokenizer)  # before the prompts are rendered with it
    check_prompt_context(cfg, hf_config, tokenizer)
    check_run_dir(cfg)
    check_resume(cfg)
    from mtrain.preflight_resume import check_resume_model
    check_resume_model(cfg, hf_config)  # a run dir of another model: one line, not a loader traceback per rank
    check_logging(cfg)
    check_reward_package(cfg)
    from mtrain.preflight_models import check_reward_fn
    check_reward_fn(cfg)  # reward.fn imports and takes (response, answer), before any model is built
    return hf_config
