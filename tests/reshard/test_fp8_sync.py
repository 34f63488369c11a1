"""An FP8 engine synced from bf16 Megatron shards equals SGLang loading the same weights as an FP8 checkpoint.

Reference, independent of the planner, the tables and the kernels: every HF linear weight block-quantized on its
own in float64 (how DeepSeek's release checkpoints store `weight` + `weight_scale_inv`), then SGLang's loader
semantics applied to that checkpoint: the FP8 weights sliced and fused exactly like bf16 ones, and the scales
sliced in block units (BlockQuantScaleParameter: a shard's scale rows are its rows / 128), via the same
sglang_reference slicing. Our path: Megatron shards -> planner (SGLangLayout fp8) -> pull jobs -> the engine-side
loader (pull_protocol, execute_scatter with BlockFp8) or push buckets -> sglang_loader.load_direct's copies. Bit
for bit, weights and scales, over training TP/PP/EP x engine TP/EP, with blocks that straddle training shards.
"""
import pytest
import torch

from mtrain.kernels import ScatterTable, execute_scatter
from mtrain.kernels.fp8 import FP8
from mtrain.layouts import LayoutError, model_layout
from mtrain.layouts.fp8 import SCALE_SUFFIX
from mtrain.reshard.executor import Executor
from mtrain.reshard.placement import MegatronLayout, SGLangLayout
from mtrain.reshard.planner import build_plan
from mtrain.reshard.pull import PullPlan
from mtrain.rollout import sglang_loader as L
from mtrain.reshard import pull_protocol as P
from mtrain.tiny_configs import tiny_config

from sglang_reference import sglang_rank_params
from test_plan_sglang import TRAIN, random_hf_state, to_megatron

BLOCK = 128
DENSE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_hidden_layers=2)
CONFIGS = {  # name: (arch, overrides, training layouts, engine (tp, ep) grid)
    # intermediate 384 at training TP2: 192-row gate/up shards, so engine blocks straddle two training ranks
    "llama_straddle": ("llama", dict(DENSE, intermediate_size=384), ["tp2", "tp1"], [(1, 1)]),
    "llama": ("llama", dict(DENSE, intermediate_size=512, num_hidden_layers=4),
              ["tp2", "tp2pp2", "pp2vpp2", "pp2uneven"], [(1, 1), (2, 1), (4, 1)]),
    "qwen2_bias": ("qwen2", dict(DENSE, intermediate_size=512), ["tp2"], [(1, 1), (2, 1)]),
    # q_norm / k_norm per head (kept bf16), tied embeddings
    "qwen3": ("qwen3", dict(DENSE, intermediate_size=512, num_hidden_layers=4, tie_word_embeddings=True),
              ["tp2", "pp2uneven"], [(1, 1), (2, 1)]),
    "qwen3_moe": ("qwen3_moe", dict(DENSE, intermediate_size=512, moe_intermediate_size=256, num_experts=4),
                  ["tp2ep2", "ep2", "tp2etp1ep2"], [(1, 1), (2, 1), (2, 2)]),
    # MLA: fused q_a + kv_a (256 + 192 rows: a partial last block), q_b/kv_b heads, shared and routed experts
    "deepseek_v3": ("deepseek_v3", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                        num_hidden_layers=2, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
                                        qk_rope_head_dim=64, v_head_dim=64, intermediate_size=512,
                                        moe_intermediate_size=256, n_routed_experts=4, n_group=2, topk_group=1,
                                        num_experts_per_tok=2),
                    ["tp2", "tp2ep2", "tp2etp1ep2"], [(1, 1), (2, 1), (2, 2)]),
}


def ref_quant(w: torch.Tensor):
    """Float64 DeepSeek block quantization of one HF tensor: (fp8 values as uint8, float32 scales)."""
    x = w.to(torch.float64)
    n, k = x.shape
    q = torch.empty(n, k, dtype=torch.uint8)
    s = torch.empty(-(-n // BLOCK), -(-k // BLOCK), dtype=torch.float32)
    for i in range(0, n, BLOCK):
        for j in range(0, k, BLOCK):
            blk = x[i:i + BLOCK, j:j + BLOCK]
            scale = torch.tensor(float(blk.abs().max()) / 448.0).to(torch.float32)
            s[i // BLOCK, j // BLOCK] = scale
            v = (blk / scale.double()).clamp(-448, 448) if scale > 0 else blk * 0.0
            q[i:i + BLOCK, j:j + BLOCK] = v.to(torch.float32).to(FP8).view(torch.uint8)
    return q, s


def fp8_checkpoint_as_sglang_loads_it(hf, cfg, layout, rank, tp, ep):
    """{param: expected tensor} for one engine rank: FP8 weights (uint8 bits) and their scales."""
    linear = {p.name for w in layout.weights if w.block_fp8 for p in w.hf}
    qs = {n: ref_quant(t) for n, t in hf.items() if n in linear}
    weights = sglang_rank_params({n: qs[n][0] if n in qs else t for n, t in hf.items()}, cfg, rank, tp, ep)
    scales = sglang_rank_params({n: qs[n][1] if n in qs else t for n, t in hf.items()}, cfg, rank, tp, ep)
    fp8_names = {w.sglang[0].name for w in layout.weights if w.block_fp8 and w.sglang}
    out = {}
    for name, t in weights.items():
        out[name] = t
        if name in fp8_names:
            out[name + SCALE_SUFFIX] = scales[name]
    return out, fp8_names


def engine_params(plan, rank):
    """An FP8 engine rank's parameters as SGLang creates them: fp8 weights, float32 scales, the rest bf16."""
    out = {}
    for k, ref in plan.dst_tensors.items():
        if k[0] != rank:
            continue
        if k in plan.quant:
            out[k[2]] = torch.full(ref.shape, 0x7F, dtype=torch.uint8).view(FP8)  # NaN bytes
            q = plan.quant[k]
            out[q.scale_name] = torch.full(q.scale_shape, float("nan"))
        else:
            out[k[2]] = torch.full(ref.shape, float("nan"),
                                   dtype=torch.float32 if k in plan.fp32 else torch.bfloat16)
    return out


def check(params, want, fp8_names, what, storage=lambda t: t):
    """Every engine parameter equals want's; an FP8 one compared as bytes of its storage (`storage`: the [N, K]
    tensor behind the engine's parameter)."""
    assert set(params) == set(want), set(params) ^ set(want)
    for name, ref in want.items():
        got = params[name]
        if name in fp8_names:
            assert got.dtype == FP8, name
            assert torch.equal(storage(got).view(torch.uint8), ref), f"{what}: {name}"
        else:
            assert torch.equal(got.float(), ref.to(got.dtype).float()), f"{what}: {name}"


def sync_both_ways(plan, ex, tp: int, want: dict, what: str, make_params=None, check_params=None,
                   count_bytes: bool = False) -> None:
    """Pull (the engine's loader quantizes straight from the trainer's shards), then push (bf16 buckets, the loader's
    copy quantizes), each into fresh parameters of every engine rank (`make_params`, default engine_params), each
    checked against want[rank] (`check_params`, default check); count_bytes: the pull jobs' bytes are exactly the
    parameters' bytes."""
    make_params, check_params = make_params or engine_params, check_params or check
    pull, sender = PullPlan(ex), P.PullSender(tp)
    params = {r: make_params(plan, r) for r in range(tp)}
    states = {r: P.PullState() for r in range(tp)}
    for bucket in pull.jobs():
        for r, job in bucket.items():
            P.run_pull(params[r], sender.payload(r, job, False, torch.empty(0)), state=states[r])
            sender.confirm(r, job)
    for r in range(tp):
        check_params(params[r], *want[r], f"{what} pull rank {r}")
    if count_bytes:
        written = sum(v.numel() * v.element_size() for p in params.values() for v in p.values())
        assert sum(j.nbytes for b in pull.jobs() for j in b.values()) == written
    params = {r: make_params(plan, r) for r in range(tp)}
    for bucket in ex.stream():
        for r, named in bucket.items():
            L.apply_copies(L.plan_copies(params[r], named), params[r])
    for r in range(tp):
        check_params(params[r], *want[r], f"{what} push rank {r}")


def setup(name):
    arch, over, trains, grid = CONFIGS[name]
    cfg = tiny_config(arch, **over)
    layout = model_layout(cfg)
    hf = {k: v.to(torch.bfloat16).float() for k, v in random_hf_state(layout).items()}  # a bf16 trainer's values
    return cfg, layout, hf, trains, grid


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp8_pull_and_push_equal_sglang_loading_an_fp8_checkpoint(name):
    cfg, layout, hf, trains, grid = setup(name)
    for train in trains:
        t = TRAIN[train]
        mcore = {k: v.to(torch.bfloat16) for k, v in to_megatron(layout, hf, t).items()}
        for tp, ep in grid:
            plan = build_plan(layout, t, SGLangLayout(tp=tp, ep=ep, fp8=True), colocate=lambda r: 0)
            ex = Executor(plan, 0, lambda ref: mcore[(ref.rank, ref.chunk, ref.name)], dtype=torch.bfloat16,
                          src_everywhere=True, backend="torch", bucket_bytes=1 << 20)
            want = {r: fp8_checkpoint_as_sglang_loads_it(hf, cfg, layout, r, tp, ep) for r in range(tp)}
            sync_both_ways(plan, ex, tp, want, f"{name} {train} engine tp{tp} ep{ep}", count_bytes=True)


def test_fp8_plan_triton_kernel_equals_torch_executor():
    """The same pull tables through the Triton kernel (interpreted): bit-equal to the torch executor."""
    cfg, layout, hf, _, _ = setup("llama_straddle")
    t = TRAIN["tp2"]
    mcore = {k: v.to(torch.bfloat16) for k, v in to_megatron(layout, hf, t).items()}
    plan = build_plan(layout, t, SGLangLayout(tp=1, fp8=True), colocate=lambda r: 0)
    ex = Executor(plan, 0, lambda ref: mcore[(ref.rank, ref.chunk, ref.name)], dtype=torch.bfloat16,
                  src_everywhere=True, backend="torch")
    (job,) = [b[0] for b in PullPlan(ex).jobs()]
    results = []
    for backend in ("torch", "triton"):
        params = engine_params(plan, 0)
        names, dsts, quant = P._resolve_targets({"targets": [[n, list(s)] for n, s in job.targets],
                                                  "quant": [[i, q.scale_name, list(q.scale_shape), list(q.block)]
                                                            for i, q in job.quant.items()]}, params)
        execute_scatter(dsts, [s.view(-1) for s in job.sources], ScatterTable.from_rows(job.rows), backend=backend,
                        quant=quant)
        results.append(params)
    for n, v in results[0].items():
        a, b = (v.view(torch.uint8) if v.dtype == FP8 else v), results[1][n]
        assert torch.equal(a, b.view(torch.uint8) if b.dtype == FP8 else b), n
    assert len(job.quant) == 2 * 4  # qkv, o_proj, gate_up, down per layer: every linear weight, nothing else


@pytest.mark.parametrize("name, engine, match", [
    ("qwen3_moe", (4, 1), r"expert intermediate size .* got 64 at parallel size 4"),
    ("llama_straddle", (2, 1), r"L0.gate_up .* fused part .* got 192 at parallel size 2"),
    ("llama", (8, 1), None),  # heads 4 < tp 8: the bf16 layout already refuses it
])
def test_fp8_shapes_sglang_cannot_block_are_refused_at_planning(name, engine, match):
    cfg, layout, _, _, _ = setup(name)
    with pytest.raises(LayoutError, match=match or "divisible"):
        build_plan(layout, MegatronLayout(), SGLangLayout(tp=engine[0], ep=engine[1], fp8=True))
    if match:  # the same engine without FP8 is fine
        build_plan(layout, MegatronLayout(), SGLangLayout(tp=engine[0], ep=engine[1]))


def test_only_linear_weights_are_fp8():
    cfg, layout, _, _, _ = setup("deepseek_v3")
    plan = build_plan(layout, MegatronLayout(), SGLangLayout(tp=1, fp8=True))
    fp8 = sorted({k[2].split("layers.1.")[-1] for k in plan.quant if ".layers.1." in k[2]})
    assert fp8 == ["mlp.experts.w13_weight", "mlp.experts.w2_weight", "mlp.shared_experts.down_proj.weight",
                   "mlp.shared_experts.gate_up_proj.weight", "self_attn.fused_qkv_a_proj_with_mqa.weight",
                   "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "self_attn.q_b_proj.weight"]
    q = plan.quant[(0, 0, "model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.weight")]
    assert q.scale_name.endswith("fused_qkv_a_proj_with_mqa.weight_scale_inv") and q.scale_shape == (4, 2)
    assert plan.quant[(0, 0, "model.layers.1.mlp.experts.w13_weight")].scale_shape == (4, 4, 2)  # [E, 2*256/128, 256/128]


def _rank_main(rank, world, name, train_name, engine_tp):
    """One rank of a real gloo job: only its own shards; the owner (rank 0) runs the engine-side loader."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    cfg, layout, hf, _, _ = setup(name)
    train = TRAIN[train_name]
    mine = {k: v.to(torch.bfloat16) for k, v in to_megatron(layout, hf, train).items() if k[0] == rank}
    plan = build_plan(layout, train, SGLangLayout(tp=engine_tp, fp8=True), colocate=lambda r: 0)
    ex = Executor(plan, rank, lambda ref: mine[(ref.rank, ref.chunk, ref.name)], dtype=torch.bfloat16,
                  bucket_bytes=64 << 10, backend="torch")
    errors = []
    for mode in ("pull", "push"):
        params = {r: engine_params(plan, r) for r in range(engine_tp)} if rank == 0 else {}
        if mode == "pull":
            pull, sender, states = PullPlan(ex), P.PullSender(engine_tp), {r: P.PullState() for r in range(engine_tp)}
            for bucket in pull.jobs():  # slices from rank 1 land in the owner's receive buffers
                for r, job in bucket.items():
                    P.run_pull(params[r], sender.payload(r, job, False, torch.empty(0)), state=states[r])
                    sender.confirm(r, job)
        else:
            for bucket in ex.stream():
                for r, named in bucket.items():
                    L.apply_copies(L.plan_copies(params[r], named), params[r])
        for r in params:
            try:
                check(params[r], *fp8_checkpoint_as_sglang_loads_it(hf, cfg, layout, r, engine_tp, 1),
                      f"{name} {train_name} gloo {mode} rank {r}")
            except AssertionError as e:
                errors.append(str(e))
    dist.destroy_process_group()
    return errors, (sum(b.numel() for b in pull.recv_bufs.values()) if rank == 0 else 0)


@pytest.mark.parametrize("name, train, engine_tp", [
    ("llama_straddle", "tp2", 1),
    pytest.param("qwen3_moe", "tp2ep2", 2, marks=pytest.mark.slow),  # 4 ranks
])
def test_fp8_over_gloo_ranks(name, train, engine_tp):
    from mtrain.dist import run_on_ranks
    results = run_on_ranks(_rank_main, TRAIN[train].world, name, train, engine_tp, timeout=300)
    assert all(not errors for errors, _ in results), results
    assert results[0][1] > 0  # the owner received slices from the other rank
