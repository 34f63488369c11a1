"""Pull mode end to end on CPU: Megatron shards -> PullPlan jobs -> the engine-side loader (pull_protocol) writing
SGLang-named per-rank parameters equals SGLang's own slicing of the full HF tensors (independent reference), bit
for bit, in one process and across real gloo ranks (slices other ranks send land in reused receive buffers)."""
import pytest
import torch
import torch.distributed as dist

from mtrain.dist import run_on_ranks
from mtrain.layouts import model_layout
from mtrain.reshard.executor import Executor
from mtrain.reshard.placement import MegatronLayout, SGLangLayout
from mtrain.reshard.planner import build_plan
from mtrain.reshard.pull import PullPlan
from mtrain.reshard import pull_protocol as P
from mtrain.tiny_configs import tiny_config

from sglang_reference import sglang_rank_params
from test_plan_sglang import TRAIN, _moe, random_hf_state, to_megatron


def engine_params(plan, rank: int, dtype) -> dict[str, torch.Tensor]:
    """An engine rank's parameters as SGLang holds them (fp32 where the plan says so), filled with NaN."""
    return {k[2]: torch.full(ref.shape, float("nan"), dtype=torch.float32 if k in plan.fp32 else dtype)
            for k, ref in plan.dst_tensors.items() if k[0] == rank}


def run_sync(pull: PullPlan, params: dict, states: dict, sender: P.PullSender, n_ranks: int) -> list[int]:
    """One sync the way WeightSync + SGLangEngine.pull_weights + the loader do it, minus CUDA IPC.
    Returns the number of tensors each call carried."""
    carried = []
    for i, bucket in enumerate(pull.jobs()):  # each bucket is applied before the next is requested
        for r in range(n_ranks):
            if r not in bucket:
                continue
            payload = sender.payload(r, bucket[r], finish=i == len(pull.buckets) - 1, marker=torch.empty(0))
            carried.append(len(payload))
            P.run_pull(params[r], payload, state=states[r])
            sender.confirm(r, bucket[r])
    return carried


def check(params, hf, cfg, engine_tp, engine_ep, ranks, dtype):
    for r in ranks:
        want = sglang_rank_params(hf, cfg, r, engine_tp, engine_ep)
        assert set(params[r]) == set(want), set(params[r]) ^ set(want)
        for name, ref in want.items():
            got = params[r][name]
            assert torch.equal(got, ref.to(got.dtype)), f"engine rank {r}: {name}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("train", ["tp1", "tp2", "tp2pp2", "ep2", "tp2ep2"])
def test_pull_in_one_process_equals_sglang_slicing(arch, train):
    t = TRAIN[train]
    if t.ep > 1 and not _moe(arch):
        pytest.skip("EP needs experts")
    cfg = tiny_config(arch)
    layout = model_layout(cfg)
    hf = random_hf_state(layout)
    # A bf16 trainer: the fp32 parameters SGLang keeps (DeepSeek's expert bias) get the bf16 values widened.
    mcore = {k: v.to(torch.bfloat16) for k, v in to_megatron(layout, hf, t).items()}
    hf = {k: v.to(torch.bfloat16).float() for k, v in hf.items()}
    for engine_tp, engine_ep in [(1, 1), (2, 1), (4, 1)] + ([(2, 2)] if _moe(arch) else []):
        plan = build_plan(layout, t, SGLangLayout(tp=engine_tp, ep=engine_ep), colocate=lambda r: 0)
        ex = Executor(plan, 0, lambda ref: mcore[(ref.rank, ref.chunk, ref.name)], dtype=torch.bfloat16,
                      src_everywhere=True, backend="torch")
        pull = PullPlan(ex)
        assert not pull.exchanges and len(pull.buckets) == 1  # everything local: one engine call per sync
        params = {r: engine_params(plan, r, torch.bfloat16) for r in range(engine_tp)}
        states = {r: P.PullState() for r in range(engine_tp)}
        sender = P.PullSender(engine_tp)
        first = run_sync(pull, params, states, sender, engine_tp)
        check(params, hf, cfg, engine_tp, engine_ep, range(engine_tp), torch.bfloat16)
        for p in params.values():  # garble, sync again: only the specs travel now, the result is the same
            for v in p.values():
                v.fill_(float("nan"))
        again = run_sync(pull, params, states, sender, engine_tp)
        assert all(n > 1 for n in first) and all(n == 1 for n in again)
        check(params, hf, cfg, engine_tp, engine_ep, range(engine_tp), torch.bfloat16)
        written = sum(v.numel() * v.element_size() for p in params.values() for v in p.values())
        assert sum(j.nbytes for b in pull.jobs() for j in b.values()) == written  # float32 weights at 4 bytes
    # A parameter given new memory (`.data = ...`, as an offload/reload would): the engine gets fresh sources.
    moved = next(k for k in mcore if k[2].endswith("linear_fc2.weight"))
    old = mcore[moved].data
    mcore[moved].data = old.clone()
    old.fill_(float("nan"))  # an engine still reading the old memory would fail the check below
    for p in params.values():
        for v in p.values():
            v.fill_(float("nan"))
    assert any(n > 1 for n in run_sync(pull, params, states, sender, engine_tp))  # the ranks that read it
    check(params, hf, cfg, engine_tp, engine_ep, range(engine_tp), torch.bfloat16)


def _rank_main(rank, world, arch, train, engine_tp):
    dist.init_process_group("gloo")
    cfg = tiny_config(arch)
    layout = model_layout(cfg)
    hf = random_hf_state(layout)
    mine = {k: v for k, v in to_megatron(layout, hf, train).items() if k[0] == rank}  # only my shards
    plan = build_plan(layout, train, SGLangLayout(tp=engine_tp), colocate=lambda r: 0)
    ex = Executor(plan, rank, lambda ref: mine[(ref.rank, ref.chunk, ref.name)], dtype=torch.float32,
                  bucket_bytes=4096, backend="torch")
    pull = PullPlan(ex)
    params = {r: engine_params(plan, r, torch.float32) for r in range(engine_tp)} if rank == 0 else {}
    states = {r: P.PullState() for r in range(engine_tp)}
    sender = P.PullSender(engine_tp)
    calls = []
    for _ in range(2):  # the second sync reuses tables, sources and receive buffers
        for p in params.values():
            for v in p.values():
                v.fill_(float("nan"))
        calls.append(run_sync(pull, params, states, sender, engine_tp))
    errors = []
    if rank == 0:
        try:
            check(params, hf, cfg, engine_tp, 1, range(engine_tp), torch.float32)
        except AssertionError as e:
            errors.append(str(e))
    dist.destroy_process_group()
    return errors, calls, len(pull.buckets), sum(b.numel() for b in pull.recv_bufs.values())


@pytest.mark.parametrize("arch, train, engine_tp", [
    ("qwen2", MegatronLayout(tp=2), 1),
    ("deepseek_v3", MegatronLayout(tp=2, pp=2), 2),
])
def test_pull_over_gloo_equals_sglang_slicing(arch, train, engine_tp):
    results = run_on_ranks(_rank_main, train.world, arch, train, engine_tp, timeout=300)
    for errors, _, _, _ in results:
        assert not errors, errors
    errors, calls, n_buckets, recv_numel = results[0]
    assert n_buckets > 1 and recv_numel > 0  # bounded buckets, slices received from the other ranks
    assert all(n == 1 for n in calls[1])  # second sync: specs only
    assert all(not c for _, cs, _, _ in results[1:] for c in cs)  # only the owner talks to the engine


def test_non_contiguous_source_is_refused():
    cfg = tiny_config("llama")
    layout = model_layout(cfg)
    mcore = to_megatron(layout, random_hf_state(layout), MegatronLayout())
    name = next(k for k, v in mcore.items() if v.dim() == 2)
    mcore[name] = mcore[name].t().contiguous().t()
    plan = build_plan(layout, MegatronLayout(), SGLangLayout(tp=1))
    ex = Executor(plan, 0, lambda ref: mcore[(ref.rank, ref.chunk, ref.name)], backend="torch")
    with pytest.raises(ValueError, match=f"source {name[2]} on rank 0 is not contiguous"):
        next(PullPlan(ex).jobs())
