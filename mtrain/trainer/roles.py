"""The one place that reads the feature flags: it builds each role of the loop from the config.

    placement    which ranks train and which host engines (trainer/placement.py)
    generation   single-turn, multi-turn tools (multi_turn.rollout_fn) or agents (serve.agent)
    source       synchronous, partial (rollout.partial), one_step or stream (rollout.async)
    learner      the policy with its parts (estimator: group baseline or the critic's GAE; terms: distillation;
                 KL reference; uniform-group filter; offload) on training ranks, NoLearner on engine ranks
    publisher    colocated pull, LoRA adapters, or point to point to separate engines

The construction order is the same on every rank where a part's construction runs collectives over the whole job
(the optimizer's parameter-group gathers, the background rollouts' new_group). docs/design-trainer.md.
"""
from __future__ import annotations

from mtrain.models.lora import spec_of as lora_spec_of
from mtrain.rollout.pool import RolloutPool
from mtrain.trainer.engines import make_engine, weight_loader
from mtrain.trainer.placement import EngineMemory


def build_roles(t, hf_dir) -> None:
    """Sets on the trainer `t`: actor (None on engine ranks), learner, engine, engine_part, pool, generate, source,
    sync (the publisher) and memory."""
    cfg, d = t.cfg, t.decisions
    lora = lora_spec_of(cfg)
    t.learner, t.actor = _learner(t) if t.placement.trains else (_no_learner(cfg), None)
    t.engine = make_engine(cfg, hf_dir, t.hf_config, d, t.rank) if d.groups.is_leader(t.rank) else None
    # An engine spanning nodes: the first group rank on each further node starts that node's part (docs/design-pool.md)
    t.engine_part = make_engine(cfg, hf_dir, t.hf_config, d, t.rank) if (
        t.engine is None and t.placement.trains and d.groups.starts_engine_part(t.rank)) else None
    t.pool = RolloutPool(d.groups, t.rank, t.engine, max_groups_in_flight=cfg.rollout.max_groups_in_flight)
    # a LoRA engine keeps its (frozen) base weights while training runs: only the KV cache is given back
    t.memory = EngineMemory(t.engine, d.colocate, () if lora is not None else ("weights",))
    if t.actor is not None:
        t.learner.memory = t.memory
    t.generate = _generation(t, hf_dir)
    t.source = _source(t)
    t.sync = _publisher(t, lora)


def _no_learner(cfg):
    """An engine rank's learner joins the whole-job collectives of the training ranks' trained models: the
    policy's, and the critic's with algo.name=ppo (SideModels' extra_models). A teacher or KL reference is frozen:
    no optimizer, no checkpoint part, nothing to join."""
    from mtrain.trainer.learner.engine_rank import NoLearner
    return NoLearner(extra_models=("critic",) if cfg.algo.name == "ppo" else ())


def _learner(t):
    from mtrain.trainer.learner.actor import Actor
    from mtrain.trainer.learner.offload import TrainOffload
    from mtrain.trainer.learner.policy import DropUniformGroups, KeepAllGroups, NoReference, PolicyLearner
    from mtrain.trainer.learner.scoring import EngineWhenCurrent, Recompute
    from mtrain.trainer.learner.side_models import SideModels
    from mtrain.trainer.learner.teacher import Distiller, build_teacher
    cfg, d = t.cfg, t.decisions
    load = weight_loader(cfg, t.layout, t.rank)
    arch = {"sequence_parallel": d.sequence_parallel}
    actor = Actor(cfg, t.train_config, load_weights=load, overrides=arch)
    reference = Actor(cfg, t.train_config, load_weights=load, trainable=False,
                      overrides=arch) if cfg.algo.kl_coef else NoReference()
    teacher = build_teacher(cfg, t.rank, arch)  # algo.distill: on-policy distillation (trainer/learner/teacher.py)
    terms = [Distiller(cfg, teacher, d.offload_train)] if teacher is not None else []
    offload = TrainOffload(actor, d.offload_train)
    if cfg.rollout.async_mode != "off" and cfg.engine.placement == "colocated":  # engine + trainer resident
        from mtrain.trainer.memory_fit import check_colocated_fit
        fit = check_colocated_fit(cfg, actor, d.device)  # ConfigError when it cannot fit
        if t.rank == 0:
            print(fit, flush=True)
    # PPO's critic (docs/design-critic-distill.md)
    side = SideModels(cfg, t.rank, t.train_config, load, arch, d.offload_train)
    estimator = _estimator(cfg, side)
    groups_filter = DropUniformGroups(cfg) if cfg.algo.filter_uniform_groups else KeepAllGroups()
    # bitwise: the engine's logprobs are the scoring pass's whenever the rollout is of the current weights
    scorer = (EngineWhenCurrent if cfg.numerics.on_policy == "bitwise" else Recompute)(actor)
    learner = PolicyLearner(cfg, actor=actor, reference=reference, estimator=estimator, terms=terms, side=side,
                            offload=offload, groups_filter=groups_filter, memory=None, tokenizer=t.tokenizer,
                            run_dir=t.run_dir, rank=t.rank, scorer=scorer)
    return learner, actor


def _estimator(cfg, side):
    """The advantage estimator: the critic's GAE (algo.name=ppo), none of the task reward's when the teacher's term is
    the whole advantage (algo.distill.only), else the group baseline of algo.baseline."""
    from mtrain.trainer.learner.advantages import CriticGAE, GroupBaseline, NoTaskAdvantage
    from mtrain.trainer.learner.leave_one_out import LeaveOneOutBaseline
    if side.critic_step is not None:
        return CriticGAE(side.critic_step)
    if cfg.algo.distill.only and cfg.algo.distill.teacher_path:
        return NoTaskAdvantage()
    baselines = {"group_mean": GroupBaseline, "leave_one_out": LeaveOneOutBaseline}
    return baselines[cfg.algo.baseline](cfg.algo, cfg.rollout.samples_per_prompt)


def _generation(t, hf_dir):
    cfg = t.cfg
    if cfg.serve.agent:  # server-based RL: openai-client agents through each leader's front (agent_step.py)
        from mtrain.trainer.generation.agents import AgentRollout
        return AgentRollout(cfg, t.tokenizer, max_positions=t.max_positions or 4096,
                            model_name=cfg.serve.model_name or hf_dir.name)
    if cfg.multi_turn.rollout_fn:  # multi-turn tool rollouts (docs/design-tools.md)
        from mtrain.rollout.agents.setup import build_tool_server, load_rollout_fn
        from mtrain.trainer.generation.functions import MultiTurnTools
        return MultiTurnTools(cfg, t.tokenizer, t.reward_fn, t.max_positions, build_tool_server(cfg.multi_turn),
                              load_rollout_fn(cfg.multi_turn.rollout_fn))
    from mtrain.trainer.generation.functions import SingleTurn
    return SingleTurn(cfg, t.tokenizer, t.reward_fn, t.max_positions)


def _source(t):
    cfg = t.cfg
    if cfg.rollout.partial:
        from mtrain.trainer.sources.base import PartialSource
        from mtrain.trainer.sources.partial import PartialRollout
        partial = PartialRollout(cfg, t.pool, t.tokenizer, t.train_set, t.sampler, t.reward_fn)
        if getattr(t.generate, "rollout_fn", None) is not None:  # aborted trajectories resume at the same turn
            partial.use_multi_turn(t.generate.tools, t.generate.rollout_fn, t.max_positions)
        return PartialSource(t, partial)
    if cfg.rollout.async_mode == "one_step":  # step N+1 generated with weights N while step N trains
        from mtrain.trainer.sources.one_step import OneStepRollout
        return OneStepRollout(t)
    if cfg.rollout.async_mode == "stream":  # engines generate on; updates go in place (trainer/sources/stream.py)
        from mtrain.trainer.sources.stream import StreamRollout
        return StreamRollout(t)
    from mtrain.trainer.sources.base import SynchronousSource
    return SynchronousSource(t)


def _publisher(t, lora):
    cfg, d, p = t.cfg, t.decisions, t.cfg.parallel
    if t.placement.separate:  # to engines on other ranks, shard to shard (mtrain/reshard/remote.py)
        from mtrain.trainer.publishers.separate import SeparateSync

        def make_sync(table, **over):  # over: engine / engine_kind for the adapter plan; push/pull is moot here
            side = {"engine": over.get("engine", t.engine)} if t.actor is None else {"chunks": t.actor.chunks}
            return SeparateSync(cfg, d, table, t.rank, dtype=d.engine_dtype, engine_kind=over.get("engine_kind"),
                                **side)
    else:
        from mtrain.trainer.publishers.colocated import WeightSync

        def make_sync(table, **over):  # over: engine / engine_kind / mode for the adapter plan (lora_sync.py)
            kw = {"engine": t.engine, "engine_kind": d.engine_layout, "mode": d.sync_mode, **over}
            return WeightSync(table, t.actor.chunks, kw.pop("engine"), groups=d.groups, engine_ep=cfg.engine.ep,
                              first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers,
                              dtype=d.engine_dtype, bucket_bytes=cfg.sync.bucket_mb << 20,
                              backend=cfg.sync.backend, device=d.device, engine_fp8=d.engine_fp8,
                              fp8_scaling=d.fp8_scaling, **kw)
    if lora is None:
        return make_sync(t.layout)
    # LoRA: the base once, then a named adapter per step (mtrain/trainer/publishers/lora.py)
    from mtrain.trainer.publishers.lora import AdapterSync
    # stream syncs with requests paused in place on the previous adapter: they keep it (lora_adapters.py)
    # model.train_vision: the vision tower trains in full beside the adapters and its rows travel every sync
    return AdapterSync(make_sync, t.layout, lora, t.engine, keep_in_use=cfg.rollout.async_mode == "stream",
                       train_vision=cfg.model.train_vision)
