"""Shard-to-shard sync into engines on other ranks (engine.placement=separate), across real gloo processes.

Training ranks build real Megatron-core models (tiny configs) and load a random HF state through the layout tables;
engine ranks (global ranks after them) hold nothing but their engine's parameters, allocated as SGLang creates them
and filled with NaN. After the sync every engine rank's parameters are bit-equal to SGLang's own slicing of the same
HF state (tests/reshard/sglang_reference.py, written from SGLang's weight loaders, independent of the planner); an
FP8 engine's weights and scales equal SGLang loading the float64-quantized FP8 checkpoint. A second sync after the
trainer's weights changed (x2, exact) must carry the new values through the cached tables and receive buffers.
"""
import pytest
import torch

from mtrain.dist import run_on_ranks

from test_fp8_sync import DENSE, engine_params, fp8_checkpoint_as_sglang_loads_it
from sglang_reference import sglang_rank_params
from test_plan_sglang import random_hf_state


def _rank_main(rank, world, arch, over, par, n_train, engine_tp, n_engines, fp8):
    import torch.distributed as dist

    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.models import build_model
    from mtrain.reshard import pull_protocol as P
    from mtrain.reshard.megatron_side import current_layout, load_hf_into_megatron, tensor_lookup
    from mtrain.reshard.placement import MegatronLayout, SGLangLayout
    from mtrain.reshard.remote import EngineRanks, RemoteSync, engine_plans
    from mtrain.tiny_configs import tiny_config

    info = init_distributed(**par, train_world=n_train)
    assert (info is None) == (rank >= n_train)
    cfg = dict(tiny_config(arch, **over), num_nextn_predict_layers=0)
    layout = model_layout(cfg, mtp=False)
    hf = random_hf_state(layout)
    if fp8:  # a bf16 trainer's values: the sync moves bf16, the engine quantizes
        hf = {k: v.to(torch.bfloat16).float() for k, v in hf.items()}
    model = par.get("tp", 1) * par.get("pp", 1)
    src = MegatronLayout(tp=par.get("tp", 1), pp=par.get("pp", 1), ep=par.get("ep", 1), etp=par.get("tp", 1),
                         dp=n_train // model)
    dst = SGLangLayout(tp=engine_tp, fp8=fp8)
    engines = EngineRanks.after(n_train, n_engines * engine_tp, engine_tp)
    plans = engine_plans(layout, src, dst, engines)
    dtype = torch.bfloat16 if fp8 else torch.float32
    errors, checked = [], 0
    if info is not None:  # a training rank: a real Megatron model, only its own shards
        assert current_layout() == src, (current_layout(), src)
        chunks, _ = build_model(cfg, params_dtype=torch.float32)
        load_hf_into_megatron(layout, chunks, lambda n: hf[n], rank)
        sync = RemoteSync(plans, engines, rank, tensor_lookup(chunks), dtype=dtype, bucket_bytes=64 << 10,
                          backend="torch")
        sent = sync.run()["sync/bytes"]
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    p.mul_(2)
        sync.run()
        dist.barrier()
        return errors, checked, sent
    g, r = engines.engine_of(rank)
    plan = plans[g]
    if fp8:
        params = engine_params(plan, r)
    else:
        params = {k[2]: torch.full(ref.shape, float("nan"), dtype=dtype) for k, ref in plan.dst_tensors.items()
                  if k[0] == r}
    sender, state = P.PullSender(1), P.PullState()

    def write(job, final):  # what the engine's loader runs on its own parameters (SGLang's scheduler, in-process)
        if job is not None:
            P.run_pull(params, sender.payload(0, job, final, torch.empty(0)), state)
            sender.confirm(0, job)

    sync = RemoteSync(plans, engines, rank, dtype=dtype, bucket_bytes=64 << 10, backend="torch")
    for scale in (1, 2):
        sync.run(write)
        full = {k: v * scale for k, v in hf.items()}
        if fp8:
            want, fp8_names = fp8_checkpoint_as_sglang_loads_it(full, cfg, layout, r, engine_tp, 1)
        else:
            want, fp8_names = sglang_rank_params(full, cfg, r, engine_tp), set()
        if set(want) != set(params):
            errors.append(f"names differ: {sorted(set(want) ^ set(params))[:4]}")
        for name, ref in want.items():
            got = params.get(name)
            if got is None:
                continue
            same = torch.equal(got.view(torch.uint8), ref) if name in fp8_names else \
                torch.equal(got, ref.to(got.dtype))
            checked += 1
            if not same:
                errors.append(f"sync {scale}: engine {g} rank {r}: {name}")
    dist.barrier()
    return errors, checked, 0.0


def _run(arch, over, par, n_train, engine_tp, n_engines, fp8=False):
    world = n_train + n_engines * engine_tp
    results = run_on_ranks(_rank_main, world, arch, over, par, n_train, engine_tp, n_engines, fp8, timeout=600)
    for errors, _, _ in results:
        assert not errors, errors[:6]
    assert all(n > 0 for _, n, _ in results[n_train:]), "every engine rank checks its parameters"
    assert all(sent > 0 for _, _, sent in results[:n_train]), "every training rank sends a share"


@pytest.mark.parametrize("arch, par, n_train, engine_tp, n_engines", [
    ("llama", dict(tp=2), 2, 2, 1),  # each engine rank takes rectangles from both training ranks
    ("qwen3_moe", dict(ep=2), 2, 1, 1),  # experts spread over EP ranks land in one fused w13/w2
])
def test_remote_sync_bit_equal(arch, par, n_train, engine_tp, n_engines):
    _run(arch, {}, par, n_train, engine_tp, n_engines)


@pytest.mark.slow
@pytest.mark.parametrize("arch, par, n_train, engine_tp, n_engines", [
    ("llama", dict(pp=2), 2, 1, 2),  # two engines, each pulls from both pipeline stages
    ("llama", dict(tp=2), 2, 4, 1),
    ("qwen3", dict(tp=2), 2, 1, 2),
    ("qwen3", dict(pp=2), 2, 2, 1),
    ("qwen3_moe", dict(tp=2), 2, 2, 1),
    ("qwen3_moe", dict(ep=2), 2, 4, 1),
    ("qwen3_moe", dict(tp=1), 2, 2, 1),  # DP2: the two replicas share the sending
])
def test_remote_sync_bit_equal_matrix(arch, par, n_train, engine_tp, n_engines):
    _run(arch, {}, par, n_train, engine_tp, n_engines)


@pytest.mark.slow
@pytest.mark.parametrize("engine_tp", [1, 2])
def test_remote_sync_fp8_engine_quantizes_on_receipt(engine_tp):
    # 384: 128-row blocks straddle the training TP2 shards (192 rows); engine TP2 needs whole blocks per rank (768)
    _run("llama", dict(DENSE, intermediate_size=384 if engine_tp == 1 else 768), dict(tp=2), 2, engine_tp, 1, fp8=True)
