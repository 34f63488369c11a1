"""Per-channel FP8 engines (engine.fp8_scaling=channel): the sync equals SGLang quantizing the same bf16 weights.

Reference, independent of the planner, the tables and the kernels: SGLang's bf16 per-rank parameters (the
sglang_reference slicing of the HF weights, fused as SGLang fuses them), then each FP8 weight quantized row by row
from the formula of SGLang's per-token kernel (written here in float64: kernels/fp8_channel.py's docstring), the
engine holding `weight` as the [K, N] transposed view of the [N, K] bytes and `weight_scale` as [1, N]. Our path:
Megatron shards -> planner (SGLangLayout fp8, fp8_scaling channel) -> pull jobs -> the engine-side loader, or push
buckets -> sglang_loader. Shapes: a SmolLM2-like Llama whose hidden size (192) and q/k/v rows are no multiple of
128, which block FP8 refuses; engine TP 2 quantizes the row-parallel layers' rows over each rank's columns.
"""
import numpy as np
import pytest
import torch

from mtrain.kernels import ScatterTable, execute_scatter
from mtrain.kernels.fp8 import FP8
from mtrain.layouts import LayoutError, model_layout
from mtrain.layouts.fp8 import CHANNEL_SCALE_SUFFIX
from mtrain.reshard import pull_protocol as P
from mtrain.reshard.executor import Executor
from mtrain.reshard.placement import MegatronLayout, SGLangLayout
from mtrain.reshard.planner import build_plan, resolve_fp8_scaling
from mtrain.reshard.pull import PullPlan
from mtrain.reshard.targets import LoaderError
from mtrain.rollout import sglang_loader as L
from mtrain.tiny_configs import tiny_config

from sglang_reference import sglang_rank_params
from test_fp8_sync import check as check_bytes
from test_fp8_sync import sync_both_ways
from test_plan_sglang import TRAIN, random_hf_state, to_megatron

SMOL = dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=2, head_dim=32, intermediate_size=320,
            num_hidden_layers=2)
# SmolLM2-135M's own shapes (hidden 576, q/k/v 576/192/192 rows, intermediate 1536), two layers
SMOLLM2 = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
               num_hidden_layers=2)


def ref_channels(t: torch.Tensor):
    """Row by row in float64 from the formula: (fp8 bits uint8 [N, K], float32 scale [1, N])."""
    x = t.to(torch.float32).double().numpy()
    tiny, c = np.finfo(np.float32).tiny, float(np.float32(1 / 448))
    q = torch.empty(x.shape, dtype=torch.uint8)
    s = torch.empty(1, x.shape[0], dtype=torch.float32)
    for i, row in enumerate(x):
        row = np.where(np.abs(row) < tiny, row * 0.0, row)
        scale = float(np.float32(np.abs(row).max() * c))
        scale = 0.0 if scale < tiny else scale
        s[0, i] = scale
        v = row * float(np.float32(1 / scale)) if scale > 0 else row * 0.0
        v = np.clip(v.astype(np.float32), -448, 448)
        q[i] = torch.from_numpy(v).to(FP8).view(torch.uint8)
    return q, s


def as_sglang_quantizes_it(hf, cfg, layout, rank, tp):
    """{param: expected} for one engine rank: FP8 storage bits [N, K] + weight_scale [1, N]; the rest bf16."""
    bf16 = sglang_rank_params(hf, cfg, rank, tp)
    fp8_names = {w.sglang[0].name for w in layout.weights if w.block_fp8 and w.sglang}
    out = {}
    for name, t in bf16.items():
        if name in fp8_names:
            out[name], out[name + CHANNEL_SCALE_SUFFIX] = ref_channels(t)
        else:
            out[name] = t
    return out, fp8_names


def engine_params(plan, rank):
    """An engine rank's parameters as SGLang's per-channel path leaves them: `weight` a [K, N] view of [N, K]
    float8 storage (NaN bytes), `weight_scale` float32 [1, N] (NaN), the rest bf16 (NaN)."""
    out = {}
    for k, ref in plan.dst_tensors.items():
        if k[0] != rank:
            continue
        if k in plan.quant:
            out[k[2]] = torch.full(ref.shape, 0x7F, dtype=torch.uint8).view(FP8).t()
            q = plan.quant[k]
            out[q.scale_name] = torch.full(q.scale_shape, float("nan"))
        else:
            out[k[2]] = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16)
    return out


def check(params, want, fp8_names, what):
    for name in fp8_names:  # still SGLang's transposed view after the sync
        assert params[name].shape == want[name].t().shape, name
    check_bytes(params, want, fp8_names, what, storage=lambda t: t.t())


def setup(over=SMOL):
    cfg = tiny_config("llama", **over)
    layout = model_layout(cfg)
    hf = {k: v.to(torch.bfloat16).float() for k, v in random_hf_state(layout).items()}
    return cfg, layout, hf


@pytest.mark.parametrize("train, tp", [("tp2", 1), ("tp1", 2), ("tp2", 2)])
def test_channel_pull_and_push_equal_sglang_quantizing_bf16(train, tp):
    cfg, layout, hf = setup()
    t = TRAIN[train]
    mcore = {k: v.to(torch.bfloat16) for k, v in to_megatron(layout, hf, t).items()}
    plan = build_plan(layout, t, SGLangLayout(tp=tp, fp8=True, fp8_scaling="channel"), colocate=lambda r: 0)
    assert len(plan.quant) == tp * 4 * 2  # qkv, o, gate_up, down per layer and rank
    ex = Executor(plan, 0, lambda ref: mcore[(ref.rank, ref.chunk, ref.name)], dtype=torch.bfloat16,
                  src_everywhere=True, backend="torch", bucket_bytes=1 << 20)
    want = {r: as_sglang_quantizes_it(hf, cfg, layout, r, tp) for r in range(tp)}
    sync_both_ways(plan, ex, tp, want, f"{train} engine tp{tp}", make_params=engine_params, check_params=check)


def test_channel_pull_through_the_triton_kernel():
    """The pull tables through the Triton kernel (interpreted), as the engine-side loader resolves them: equal to
    SGLang's quantization, bit for bit."""
    cfg, layout, hf = setup()
    mcore = {k: v.to(torch.bfloat16) for k, v in to_megatron(layout, hf, TRAIN["tp2"]).items()}
    plan = build_plan(layout, TRAIN["tp2"], SGLangLayout(tp=1, fp8=True, fp8_scaling="channel"), colocate=lambda r: 0)
    ex = Executor(plan, 0, lambda ref: mcore[(ref.rank, ref.chunk, ref.name)], dtype=torch.bfloat16,
                  src_everywhere=True, backend="torch")
    params = engine_params(plan, 0)
    for bucket in PullPlan(ex).jobs():
        job = bucket[0]
        spec = {"targets": [[n, list(s)] for n, s in job.targets],
                "quant": [[i, q.scale_name, list(q.scale_shape), list(q.block), q.scaling] for i, q in job.quant.items()]}
        names, dsts, quant = P._resolve_targets(spec, params)
        assert quant and all(q.scaling == "channel" for q in quant.values())
        execute_scatter(dsts, [s.view(-1) for s in job.sources], ScatterTable.from_rows(job.rows), backend="triton",
                        quant=quant)
    check(params, *as_sglang_quantizes_it(hf, cfg, layout, 0, 1), "triton pull")


def test_fp8_scaling_auto_picks_channel_for_smollm2_and_block_where_it_fits():
    smol = model_layout(tiny_config("llama", **SMOLLM2))
    assert resolve_fp8_scaling(smol, "auto", 1) == "channel"
    with pytest.raises(LayoutError, match="divisible by 128"):
        build_plan(smol, MegatronLayout(), SGLangLayout(fp8=True))  # block, asked for explicitly
    build_plan(smol, MegatronLayout(), SGLangLayout(fp8=True, fp8_scaling="channel"))
    dense = model_layout(tiny_config("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=128, intermediate_size=512, num_hidden_layers=2))
    assert resolve_fp8_scaling(dense, "auto", 1) == "block"
    assert resolve_fp8_scaling(dense, "auto", 2) == "block"  # per-rank q/k/v 256/128/128, gate/up 256
    half = model_layout(tiny_config("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=64, intermediate_size=512, num_hidden_layers=2))
    assert resolve_fp8_scaling(half, "auto", 1) == "block"  # q/k/v rows 256/128/128
    assert resolve_fp8_scaling(half, "auto", 2) == "channel"  # per-rank k/v rows 64
    assert resolve_fp8_scaling(dense, "channel", 1) == "channel"


def test_channel_refuses_moe_experts():
    moe = model_layout(tiny_config("qwen3_moe", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=128, intermediate_size=512, moe_intermediate_size=96, num_experts=4,
                                   num_hidden_layers=2))
    with pytest.raises(LayoutError, match="one scale per expert"):
        build_plan(moe, MegatronLayout(), SGLangLayout(fp8=True, fp8_scaling="channel"))
    with pytest.raises(LayoutError, match="only for dense models"):
        resolve_fp8_scaling(moe, "auto", 1)


def test_a_plan_in_the_other_format_is_refused_by_the_engine():
    """A per-channel plan into a block engine, and a block plan into a per-channel engine: one LoaderError, nothing
    written."""
    cfg, layout, hf = setup(dict(SMOL, num_hidden_layers=1))
    mcore = {k: v.to(torch.bfloat16) for k, v in to_megatron(layout, hf, TRAIN["tp1"]).items()}
    chan = build_plan(layout, TRAIN["tp1"], SGLangLayout(fp8=True, fp8_scaling="channel"), colocate=lambda r: 0)
    ex = Executor(chan, 0, lambda ref: mcore[(ref.rank, ref.chunk, ref.name)], dtype=torch.bfloat16,
                  src_everywhere=True, backend="torch")
    (job,) = [b[0] for b in PullPlan(ex).jobs()]
    block_engine = {}
    for k, ref in chan.dst_tensors.items():
        block_engine[k[2]] = (torch.zeros(ref.shape, dtype=FP8) if k in chan.quant
                              else torch.zeros(ref.shape, dtype=torch.bfloat16))
        if k in chan.quant:
            block_engine[k[2] + "_scale_inv"] = torch.zeros(-(-ref.shape[0] // 128), -(-ref.shape[1] // 128))
    with pytest.raises(LoaderError, match="disagree on engine.fp8_scaling"):
        P.run_pull(block_engine, P.PullSender(1).payload(0, job, False, torch.empty(0)), state=P.PullState())
    # push into a per-channel engine of a bucket cut inside a weight is refused too (whole parameters only)
    params = engine_params(chan, 0)
    name = next(k[2] for k in chan.quant)
    n, k = params[name].t().shape
    with pytest.raises(LoaderError, match="written whole"):
        L.plan_copies(params, [(f"{name}@0:1", torch.zeros(1, n, dtype=torch.bfloat16))])
