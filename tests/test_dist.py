"""mtrain.dist: rank_coords equals Megatron's parallel_state, init errors, the multi-rank runner, CPU shim."""
from __future__ import annotations

import time

import pytest

from mtrain.dist import ParallelLayoutError, RankFailedError, rank_coords, run_on_ranks

LAYOUTS_WORLD4 = {
    "tp2_pp2": dict(tp=2, pp=2),
    "tp2_ep2": dict(tp=2, ep=2),
    "ep4": dict(ep=4),
    "pp2_ep2": dict(pp=2, ep=2),
    "tp2_ep2_etp1": dict(tp=2, ep=2, etp=1),
    "cp2_tp2": dict(cp=2, tp=2),
}


def _live_coords(rank: int, world: int, layouts: dict) -> dict:
    from mtrain.dist import init_distributed

    out = {name: init_distributed(**sizes) for name, sizes in layouts.items()}
    try:  # the same live job also checks the indivisible-world error
        init_distributed(tp=3)
        out["tp3_error"] = "no error"
    except ParallelLayoutError as err:
        out["tp3_error"] = str(err)
    return out


@pytest.fixture(scope="module")
def live() -> list[dict]:
    return run_on_ranks(_live_coords, 4, LAYOUTS_WORLD4, timeout=300)


@pytest.mark.parametrize("layout", sorted(LAYOUTS_WORLD4))
def test_rank_coords_match_parallel_state(live, layout):
    sizes = LAYOUTS_WORLD4[layout]
    predicted = rank_coords(4, sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("ep", 1), sizes.get("etp"), sizes.get("cp", 1))
    for rank, per_layout in enumerate(live):
        info = per_layout[layout]
        c = predicted[rank]
        got = (info.tp_rank, info.cp_rank, info.dp_rank, info.pp_rank, info.ep_rank, info.etp_rank, info.edp_rank)
        want = (c.tp, c.cp, c.dp, c.pp, c.ep, c.etp, c.edp)
        assert got == want, f"{layout} rank {rank}: parallel_state {got} != rank_coords {want}"
        assert info.rank == rank and info.world_size == 4 and info.backend == "gloo"


def test_rank_coords_world8_by_hand():
    # tp2 pp2 dp2: rank = tp + 2*dp + 4*pp ; experts tp2 ep2 pp2: rank = etp + 2*ep + 4*pp
    coords = rank_coords(8, tp=2, pp=2, ep=2)
    c5 = coords[5]
    assert (c5.tp, c5.dp, c5.pp, c5.ep, c5.etp, c5.edp) == (1, 0, 1, 0, 1, 0)
    c6 = coords[6]
    assert (c6.tp, c6.dp, c6.pp, c6.ep, c6.etp, c6.edp) == (0, 1, 1, 1, 0, 0)


@pytest.mark.parametrize(
    "world, sizes, needle",
    [
        (4, dict(tp=3, pp=1), "tp*pp*cp = 3*1*1 = 3"),
        (4, dict(tp=2, pp=1, ep=4), "etp*ep*pp = 2*4*1 = 8"),
        (4, dict(tp=0, pp=1), "tp=0"),
    ],
)
def test_rank_coords_errors_name_the_sizes(world, sizes, needle):
    with pytest.raises(ParallelLayoutError, match=needle.replace("*", r"\*")):
        rank_coords(world, **sizes)


def test_init_distributed_rejects_indivisible_world(live):
    for per_rank in live:
        assert "world_size=4 is not divisible by tp*pp*cp = 3*1*1 = 3" in per_rank["tp3_error"], per_rank["tp3_error"]


def _echo(rank: int, world: int, payload: str) -> tuple:
    return rank, world, payload


def _fail_on_rank1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    return rank


def _sleep(rank: int, world: int) -> None:
    time.sleep(60)


def test_run_on_ranks_returns_values_in_rank_order():
    assert run_on_ranks(_echo, 2, "x", timeout=60) == [(0, 2, "x"), (1, 2, "x")]


def test_run_on_ranks_reraises_child_exception_with_traceback():
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_fail_on_rank1, 2, timeout=60)
    text = str(info.value)
    assert "rank 1 of 2 failed" in text
    assert "ValueError: deliberate failure on rank one" in text
    assert "_fail_on_rank1" in text  # the child's traceback, not just the message


def test_run_on_ranks_times_out():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 3s"):
        run_on_ranks(_sleep, 2, timeout=3)
    assert time.monotonic() - start < 30


def _shim_checks(rank: int, world: int) -> dict:
    import torch

    from mtrain.compat import cpu_shim
    from mtrain.dist import init_distributed

    init_distributed(seed=7)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    assert cpu_shim.apply() is True and cpu_shim.apply() is True  # idempotent
    out = {
        "empty_cuda": torch.empty(3, device="cuda").device.type,
        "empty_index": torch.zeros(2, device=torch.cuda.current_device()).device.type,
        "to_cuda": torch.ones(2).to("cuda").device.type,
        "dot_cuda": torch.ones(2).cuda().device.type,
        "type": torch.ones(2).type(),
        "type_cast": torch.ones(2).type(torch.float64).dtype == torch.float64,
    }
    torch.cuda.synchronize()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
    out["elapsed"] = event.elapsed_time(event)
    # The tracker's named streams are reproducible and independent of the default stream.
    with get_cuda_rng_tracker().fork():
        a = torch.rand(4)
    model_parallel_cuda_manual_seed(7, force_reset_rng=True)
    with get_cuda_rng_tracker().fork():
        b = torch.rand(4)
    c = torch.rand(4)
    out["fork_reproducible"] = bool(torch.equal(a, b))
    out["fork_differs_from_default"] = not torch.equal(b, c)
    return out


def test_cpu_shim_redirects():
    out = run_on_ranks(_shim_checks, 1, timeout=120)[0]
    assert out["empty_cuda"] == out["empty_index"] == out["to_cuda"] == out["dot_cuda"] == "cpu"
    assert out["type"] == "torch.cuda.FloatTensor" and out["type_cast"]
    assert out["elapsed"] == 0.0
    assert out["fork_reproducible"] and out["fork_differs_from_default"]
