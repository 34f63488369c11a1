"""Distributed set-up: torchrun environment -> torch.distributed + Megatron ``parallel_state``.

* ``init_distributed(...) -> ParallelInfo``: nccl on GPU, gloo on CPU (with ``mtrain.compat.cpu_shim``),
  Megatron's process groups and model-parallel RNG; ``destroy()`` undoes it.
* ``rank_coords(...)``: for every global rank, its coordinates exactly as ``parallel_state`` assigns them
  (order "tp-cp-ep-dp-pp"), computed without any process group — the resharding planner uses it to know
  which training rank holds which shard.
* ``run_on_ranks(fn, world_size, *args)``: the multi-rank test runner (spawned processes, torchrun-like env).
"""
from __future__ import annotations

import os
import pickle
import socket
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

MEGATRON_ORDER = "tp-cp-ep-dp-pp"  # parallel_state's default; rank_coords implements exactly this one


class ParallelLayoutError(ValueError):
    """The requested parallel sizes do not fit the world size (the message names the sizes)."""


@dataclass(frozen=True)
class RankCoords:
    """One global rank's place in every Megatron parallel group (ranks within each group)."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    etp: int
    edp: int  # expert-data-parallel rank


@dataclass(frozen=True)
class ParallelInfo:
    """Sizes of every parallel dimension and this process's ranks in them."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    tp_size: int
    pp_size: int
    vpp_size: Optional[int]
    cp_size: int
    dp_size: int
    ep_size: int
    etp_size: int
    edp_size: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    ep_rank: int
    etp_rank: int
    edp_rank: int

    @property
    def is_first_pp_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def _sizes(world: int, tp: int, pp: int, ep: int, etp: Optional[int], cp: int) -> tuple[int, int, int]:
    """(dp, etp, edp); raises ParallelLayoutError naming the sizes when they do not divide the world."""
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp), ("world_size", world)):
        if value < 1:
            raise ParallelLayoutError(f"{name}={value} must be >= 1")
    etp = tp if etp is None else etp
    if etp < 1:
        raise ParallelLayoutError(f"etp={etp} must be >= 1")
    if world % (tp * pp * cp) != 0:
        raise ParallelLayoutError(
            f"world_size={world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp}"
        )
    if world % (etp * ep * pp) != 0:
        raise ParallelLayoutError(
            f"world_size={world} is not divisible by etp*ep*pp = {etp}*{ep}*{pp} = {etp * ep * pp}"
        )
    return world // (tp * pp * cp), etp, world // (etp * ep * pp)


def rank_coords(
    world: int, tp: int, pp: int, ep: int = 1, etp: Optional[int] = None, cp: int = 1
) -> list[RankCoords]:
    """Coordinates of every global rank, as parallel_state assigns them with order "tp-cp-ep-dp-pp".

    Megatron builds two orthogonal decompositions of the world (RankGenerator), fastest-varying first:
      dense:  rank = tp + cp*TP + dp*TP*CP + pp*TP*CP*DP
      expert: rank = etp + ep*ETP + edp*ETP*EP + pp*ETP*EP*EDP
    (EP is 1 in the dense one and CP is 1 in the expert one; both share the same pp.)
    """
    dp, etp_size, edp = _sizes(world, tp, pp, ep, etp, cp)
    out = []
    for r in range(world):
        t, rest = r % tp, r // tp
        c, rest = rest % cp, rest // cp
        d, p = rest % dp, rest // dp
        et, rest = r % etp_size, r // etp_size
        e, rest = rest % ep, rest // ep
        ed, p2 = rest % edp, rest // edp
        assert p == p2, "pp rank must agree between the dense and expert decompositions"
        out.append(RankCoords(rank=r, tp=t, cp=c, dp=d, pp=p, ep=e, etp=et, edp=ed))
    return out


def _env_int(name: str, default: Optional[int] = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"environment variable {name} is not set (launch with torchrun or set it)")
        return default
    return int(value)


def init_distributed(
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    ep: int = 1,
    etp: Optional[int] = None,
    cp: int = 1,
    seed: int = 1234,
    timeout_minutes: float = 30,
    timeout_s: Optional[float] = None,
    train_world: Optional[int] = None,
) -> Optional[ParallelInfo]:
    """Initialise torch.distributed from torchrun's env, then Megatron's parallel_state and RNG.

    A single process without torchrun variables runs as world size 1 (MASTER_ADDR/PORT defaulted).
    timeout_s (overrides timeout_minutes) bounds every collective: a rank that waits longer for a dead or hung
    peer raises (gloo) or is torn down by NCCL's watchdog, so the job ends with an error instead of hanging.
    train_world (engine.placement=separate): Megatron's groups span global ranks 0..train_world-1 only; the ranks
    past them (engine ranks) take part in creating the groups, as torch requires of every rank, belong to none, and
    get None back (they never touch Megatron).
    """
    if timeout_s is not None:
        timeout_minutes = timeout_s / 60
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mtrain.compat import cpu_shim

    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    _sizes(train_world or world, tp, pp, ep, etp, cp)
    if vpp is not None and vpp > 1 and pp < 2:
        raise ParallelLayoutError(f"vpp={vpp} needs pp >= 2 (got pp={pp})")
    vpp = vpp if vpp and vpp > 1 else None
    on_gpu = torch.cuda.is_available()
    backend = "nccl" if on_gpu else "gloo"
    if on_gpu:
        torch.cuda.set_device(local_rank)
        # A timed-out NCCL collective must end the process (3 = tear down without cleanup, torch's default
        # since 2.3); stated here so that a torch with another default cannot turn a dead peer into a silent hang.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    else:
        cpu_shim.apply()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world,
            timeout=timedelta(minutes=timeout_minutes),
            device_id=torch.device("cuda", local_rank) if on_gpu else None,
        )
    global _TRAIN_GROUP
    _TRAIN_GROUP = None if train_world is None else dist.new_group(
        list(range(train_world)), backend="gloo", timeout=timedelta(minutes=timeout_minutes))
    ps.destroy_model_parallel()
    with _megatron_world(train_world):
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            distributed_timeout_minutes=timeout_minutes,
            order=MEGATRON_ORDER,
        )
    if train_world is not None and rank >= train_world:
        torch.manual_seed(seed)
        return None
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    torch.manual_seed(seed)
    return current_parallel_info()


_TRAIN_GROUP = None


def train_group():
    """The group of the training ranks for collectives only they take part in (None = the default group, every
    rank: colocated placement, where every rank trains). Set by init_distributed."""
    return _TRAIN_GROUP


@contextmanager
def _megatron_world(train_world: Optional[int]):
    """megatron-core's initialize_model_parallel sizes its groups from `torch.distributed.get_world_size()` of the
    default group and takes no world size argument. With separate placement its groups must span the training
    ranks only (the first train_world ranks), while the default group spans the whole job (the weight transfer and
    the rollout pool use it): for the call alone, a default-group world-size query answers train_world. Megatron
    itself is not modified; queries with an explicit group pass through."""
    if train_world is None:
        yield
        return
    real = dist.get_world_size

    def world_size(group=None):
        return train_world if group is None else real(group)

    dist.get_world_size = world_size
    try:
        yield
    finally:
        dist.get_world_size = real


def current_parallel_info() -> ParallelInfo:
    """ParallelInfo read back from the live parallel_state."""
    from megatron.core import parallel_state as ps

    return ParallelInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=_env_int("LOCAL_RANK", 0),
        backend=dist.get_backend(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        vpp_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        cp_size=ps.get_context_parallel_world_size(),
        dp_size=ps.get_data_parallel_world_size(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
        edp_size=ps.get_expert_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        edp_rank=ps.get_expert_data_parallel_rank(),
    )


def destroy() -> None:
    """Tear down parallel_state and the default process group (safe to call twice)."""
    import sys

    if "megatron.core.parallel_state" in sys.modules:  # never import megatron just to tear down
        sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------- multi-rank test runner


class RankFailedError(RuntimeError):
    """A rank started by run_on_ranks raised; the message carries that rank's traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: tuple, results) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    torch.set_num_threads(1)
    try:
        value = fn(rank, world, *args)
        # Plain pickle (tensors by value): torch's queue would share tensors through a file descriptor that the
        # parent can only open while this process is alive, and this process exits right after.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent with its traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            destroy()
        except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
            pass


def _is_peer_fallout(tb: str) -> bool:
    """True for errors that only say another rank went away (gloo/TCP), not what went wrong."""
    return "Connection closed by peer" in tb or "Connection reset by peer" in tb


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return their values by rank.

    Each process gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free
    port), so ``fn`` can call ``init_distributed``. ``fn`` and its return value must be picklable (a
    module-level function). A child's exception is re-raised here as RankFailedError with its traceback;
    a hang past ``timeout`` seconds kills the children and raises TimeoutError.
    """
    import queue as queue_mod

    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, results), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    failures: list[tuple[int, str]] = []

    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and failures:
                break  # a rank failed; the others are probably stuck waiting for it
            if remaining <= 0:
                raise TimeoutError(
                    f"run_on_ranks: {world_size - len(values) - len(failures)} of {world_size} ranks "
                    f"did not finish within {timeout:.0f}s"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
                value = pickle.loads(value) if ok else value
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                reported = set(values) | {r for r, _ in failures}
                silent = [i for i in dead if i not in reported]
                if silent:
                    raise RankFailedError(
                        f"rank(s) {silent} exited with code(s) {[procs[i].exitcode for i in silent]} "
                        "without reporting (killed or crashed in native code)"
                    )
                continue
            if ok:
                values[rank] = value
            else:
                failures.append((rank, value))
                # Give the other ranks a moment to report their own errors, then stop waiting.
                deadline = min(deadline, time.monotonic() + 10.0)
    finally:
        # Ranks that all reported get a moment to exit cleanly; after a failure or timeout, don't wait.
        clean = len(values) == world_size
        for p in procs:
            p.join(timeout=10.0 if clean else 0.2)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        # A crash on one rank makes its peers fail with "Connection closed by peer": show the root cause
        # first, then every other rank's traceback.
        failures.sort(key=lambda f: (_is_peer_fallout(f[1]), f[0]))
        rank, tb = failures[0]
        others = "".join(f"\n--- rank {r} ---\n{t}" for r, t in failures[1:])
        raise RankFailedError(f"rank {rank} of {world_size} failed:\n{tb}{others}")
    return [values[r] for r in range(world_size)]

