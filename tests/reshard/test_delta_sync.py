"""Delta weight sync (sync.delta, mtrain/reshard/delta.py) across real gloo processes: 2 training ranks (Megatron TP2,
real tiny models) and 2 engine ranks (2 engines of TP1). Every step the training ranks run a full remote sync and a
delta sync; each engine rank holds two parameter sets, one written by each. After every step the delta set is bit
for bit the full one: sparse changes, no change, a 0.0 -> -0.0 flip (equal values, different bits), a dense change
that falls back to whole buffers, and a sparse change after it. The wire bytes of the sparse steps are a small share
of the full sync's.
"""
import torch

from mtrain.dist import run_on_ranks

from test_plan_sglang import random_hf_state

STEPS = ("first", "sparse", "none", "sign", "dense", "sparse")


def _perturb(params: list[torch.Tensor], kind: str, gen: torch.Generator) -> None:
    """Change the training weights (float32) so that the bf16 values the sync sends change as `kind` says."""
    with torch.no_grad():
        for p in params:
            flat = p.view(-1)
            if kind == "sparse":  # ~0.5 % of the elements, by far more than a bf16 ulp
                idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 200),), generator=gen)
                flat[idx] += 0.25 * (1 + flat[idx].abs())
            elif kind == "sign":  # the first element becomes 0.0 then -0.0 in the same step pair below
                flat[0] = -0.0 if (flat[0] == 0 and not torch.signbit(flat[0])) else 0.0
            elif kind == "dense":
                flat.mul_(2)


def _rank_main(rank, world, n_train):
    import torch.distributed as dist

    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.models import build_model
    from mtrain.reshard import pull_protocol as P
    from mtrain.reshard.delta import DeltaExecutor, DeltaSender, delta_metrics
    from mtrain.reshard.megatron_side import load_hf_into_megatron, tensor_lookup
    from mtrain.reshard.placement import MegatronLayout, SGLangLayout
    from mtrain.reshard.remote import EngineRanks, RemoteSync, engine_plans
    from mtrain.tiny_configs import tiny_config
    import functools

    info = init_distributed(tp=2, train_world=n_train)
    cfg = dict(tiny_config("llama"), num_nextn_predict_layers=0)
    layout = model_layout(cfg, mtp=False)
    hf = random_hf_state(layout)
    engines = EngineRanks.after(n_train, 2, 1)
    plans = engine_plans(layout, MegatronLayout(tp=2, pp=1, ep=1, etp=2, dp=1), SGLangLayout(tp=1), engines)
    kw = dict(dtype=torch.bfloat16, bucket_bytes=16 << 10, backend="torch")
    if info is not None:
        chunks, _ = build_model(cfg, params_dtype=torch.float32)
        load_hf_into_megatron(layout, chunks, lambda n: hf[n], rank)
        params = [p for c in chunks for p in c.parameters()]
        sender = DeltaSender()
        full = RemoteSync(plans, engines, rank, tensor_lookup(chunks), **kw)
        delta = RemoteSync(plans, engines, rank, tensor_lookup(chunks), executor=functools.partial(
            DeltaExecutor, sender=sender), **kw)
        gen = torch.Generator().manual_seed(rank)
        stats = []
        for kind in STEPS:
            _perturb(params, kind, gen)
            if kind == "sign":  # a second flip: 0.0 -> -0.0 only (the first may have moved a non-zero to 0.0)
                full.run(), sender.begin(), delta.run(), delta_metrics(sender, delta.executors)
                _perturb(params, kind, gen)
            sent = full.run()["sync/bytes"]
            sender.begin()
            delta.run()
            stats.append((kind, sent, delta_metrics(sender, delta.executors)))
        dist.barrier()
        return stats
    g, r = engines.engine_of(rank)
    sets = {}
    for name in ("full", "delta"):
        params = {k[2]: torch.full(ref.shape, float("nan"), dtype=torch.bfloat16)
                  for k, ref in plans[g].dst_tensors.items() if k[0] == r}
        sets[name] = (params, P.PullSender(1), P.PullState())

    def writer(name):
        params, sender, state = sets[name]

        def write(job, final):
            if job is not None:
                P.run_pull(params, sender.payload(0, job, final, torch.empty(0)), state)
                sender.confirm(0, job)
        return write

    full = RemoteSync(plans, engines, rank, **kw)
    delta = RemoteSync(plans, engines, rank, executor=DeltaExecutor, **kw)
    errors, checked = [], 0
    for step, kind in enumerate(STEPS):
        for _ in range(2 if kind == "sign" else 1):
            full.run(writer("full"))
            delta.run(writer("delta"))
        a, b = sets["full"][0], sets["delta"][0]
        for name in a:
            checked += 1
            if not torch.equal(a[name].view(torch.int16), b[name].view(torch.int16)):
                errors.append(f"step {step} ({kind}): engine {g}: {name} differs from the full sync's bits")
        if any(torch.isnan(t).any() for t in b.values()):
            errors.append(f"step {step}: an engine parameter was never written")
    dist.barrier()
    return errors, checked


def test_delta_sync_bit_equal_to_full_sync():
    n_train = 2
    results = run_on_ranks(_rank_main, 4, n_train, timeout=600)
    for errors, checked in results[n_train:]:
        assert not errors, errors[:6]
        assert checked > 0
    for stats in results[:n_train]:
        by = [(kind, full_bytes, m) for kind, full_bytes, m in stats]
        first, sparse, none, sign, dense, sparse2 = by
        assert first[2]["sync/delta_full_frac"] == 1.0 and first[2]["sync/wire_bytes"] >= first[1]
        for kind, full_bytes, m in (sparse, sparse2):
            assert m["sync/delta_full_frac"] == 0.0, (kind, m)
            assert 0 < m["sync/delta_changed_frac"] < 0.02, (kind, m)
            assert m["sync/wire_bytes"] < 0.1 * full_bytes, (kind, m, full_bytes)
        assert none[2]["sync/delta_changed_frac"] == 0.0 and none[2]["sync/wire_bytes"] < 0.01 * none[1]
        assert 0 < sign[2]["sync/delta_changed_frac"] < 0.01, sign  # the -0.0 flips travel
        assert dense[2]["sync/delta_full_frac"] == 1.0 and dense[2]["sync/wire_bytes"] >= dense[1]
