"""How the job's ranks split between training and engines (engine.placement), and the asynchrony checks.

`check_async(cfg)` is part of the config's cross-field checks (world-size free); `split_ranks(cfg, world)` runs in
preflight, before any process group starts, so a bad split is one line on every rank. docs/design-async.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from mtrain.config_error import ConfigError


def _fail(key: str, msg: str) -> ConfigError:
    return ConfigError(f"{key}: {msg}")


def check_async(cfg) -> None:
    """Cross-field checks of engine.placement / engine.ranks / rollout.async / rollout.max_staleness."""
    e, r = cfg.engine, cfg.rollout
    mode = r.async_mode
    if e.ranks is not None and e.placement != "separate":
        raise _fail("engine.ranks", f"is for engine.placement=separate (placement is {e.placement!r}); "
                                    "leave it unset")
    if e.placement == "separate":
        if e.ranks is None:
            raise _fail("engine.ranks", "engine.placement=separate needs engine.ranks (how many ranks host engines)")
        if e.ranks < e.tp or e.ranks % e.tp:
            raise _fail("engine.ranks", f"{e.ranks} is not a positive multiple of engine.tp={e.tp} (each engine "
                                        "spans engine.tp ranks)")
    if mode == "off":
        return
    if r.partial:
        raise _fail("rollout.async", f"{mode} with rollout.partial=true is not available; use one of them")
    if r.offpolicy == "tis" and cfg.algo.tis_cap is None:
        raise _fail("rollout.offpolicy", "tis needs algo.tis_cap (the cap of the trainer/rollout probability ratio)")
    if r.max_staleness is not None and r.max_staleness < 1:
        raise _fail("rollout.max_staleness", f"{r.max_staleness} with rollout.async={mode} leaves nothing to train "
                                             "on (every token is one version old); use >= 1 or null")


@dataclass(frozen=True)
class JobSplit:
    world: int
    placement: str
    train_ranks: tuple[int, ...]
    engine_ranks: tuple[int, ...]
    engine_tp: int

    def describe(self) -> str:
        if self.placement == "colocated":
            return (f"placement=colocated: all {self.world} ranks train and host engines "
                    f"({self.world // self.engine_tp} engine(s) of tp {self.engine_tp})")
        t, g = self.train_ranks, self.engine_ranks
        return (f"placement=separate: training ranks {t[0]}-{t[-1]} ({len(t)}), engine ranks {g[0]}-{g[-1]} "
                f"({len(g)}: {len(g) // self.engine_tp} engine(s) of tp {self.engine_tp})")


def split_ranks(cfg, world: int) -> JobSplit:
    """The split, checked against the world size and the training layout (tp x pp x cp must divide the training
    ranks). Separate placement: the last engine.ranks ranks host engines."""
    e, p = cfg.engine, cfg.parallel
    if e.placement == "colocated":
        return JobSplit(world, "colocated", tuple(range(world)), tuple(range(world)), e.tp)
    n_eng = e.ranks
    n_train = world - n_eng
    if n_train < 1:
        raise _fail("engine.ranks", f"{n_eng} engine ranks leave no training rank in a job of {world} ranks "
                                    "(torchrun --nproc-per-node x nodes)")
    model = p.tp * p.pp * p.cp
    if n_train % model:
        raise _fail("engine.ranks", f"{n_eng} engine ranks leave {n_train} training ranks, not a multiple of "
                                    f"parallel.tp x pp x cp = {p.tp} x {p.pp} x {p.cp} = {model}")
    return JobSplit(world, "separate", tuple(range(n_train)), tuple(range(n_train, world)), e.tp)


def train_world(cfg, world: int) -> int:
    """How many ranks train: all of them colocated, the ranks before engine.ranks separate."""
    return world - cfg.engine.ranks if cfg.engine.placement == "separate" else world
