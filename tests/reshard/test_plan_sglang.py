"""HF -> Megatron (any TP/PP/EP) -> SGLang (engine TP 1/2/4, EP) through the planner equals SGLang's own
slicing of the full HF tensors (an independent reference), bit for bit; HF -> Megatron -> HF is identical."""
import pytest
import torch

from mtrain.layouts import LayoutError, model_layout
from mtrain.reshard.local import reshard_in_memory
from mtrain.reshard.placement import HFLayout, MegatronLayout, SGLangLayout
from mtrain.reshard.planner import build_plan
from mtrain.tiny_configs import tiny_config

from sglang_reference import sglang_rank_params

TRAIN = {"tp1": MegatronLayout(), "tp2": MegatronLayout(tp=2), "tp2pp2": MegatronLayout(tp=2, pp=2),
         "ep2": MegatronLayout(dp=2, ep=2), "tp2ep2": MegatronLayout(tp=2, dp=2, ep=2),
         "pp2vpp2": MegatronLayout(pp=2, vpp=2), "tp2etp1ep2": MegatronLayout(tp=2, ep=2, etp=1),
         "pp2uneven": MegatronLayout(pp=2, first_stage_layers=1, last_stage_layers=3)}
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v3_no_qlora"]


def random_hf_state(layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for w in layout.weights:
        for part in w.hf:
            if part.write:
                rows = part.rows[1] - part.rows[0]
                shape = (rows,) if len(w.shape) == 1 else (rows, w.shape[1])
                out[part.name] = torch.randn(shape, generator=g)
    # DeepSeek-V3 checkpoints repeat the embedding and head inside the MTP layer; Megatron shares them.
    for name in list(out):
        if name.endswith(".embed_tokens.weight") and name != "model.embed_tokens.weight":
            out[name] = out["model.embed_tokens.weight"]
        if name.endswith(".shared_head.head.weight"):
            out[name] = out["lm_head.weight"]
    return out


def to_megatron(layout, hf, train):
    plan = build_plan(layout, HFLayout(), train, colocate=lambda r: r)
    return reshard_in_memory(plan, lambda ref: hf[ref.name], dtype=torch.float32, backend="torch")


def _moe(name):
    return name in ("qwen3_moe", "deepseek_v3", "deepseek_v3_no_qlora")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("train", list(TRAIN))
def test_megatron_to_sglang_matches_sglang_slicing(arch, train):
    t = TRAIN[train]
    if t.ep > 1 and not _moe(arch):
        pytest.skip("EP needs experts")
    cfg = tiny_config(arch)
    layout = model_layout(cfg)
    hf = random_hf_state(layout)
    mcore = to_megatron(layout, hf, t)
    for engine_tp, engine_ep in [(1, 1), (2, 1), (4, 1)] + ([(2, 2), (4, 2)] if _moe(arch) else []):
        plan = build_plan(layout, t, SGLangLayout(tp=engine_tp, ep=engine_ep), colocate=lambda r: r % t.world)
        got = reshard_in_memory(plan, mcore, dtype=torch.float32, backend="torch")
        for r in range(engine_tp):
            want = sglang_rank_params(hf, cfg, r, engine_tp, engine_ep)
            mine = {k[2]: v for k, v in got.items() if k[0] == r}
            assert set(mine) == set(want), (set(mine) ^ set(want))
            for name, ref in want.items():
                assert mine[name].shape == ref.shape, name
                assert torch.equal(mine[name], ref), f"{arch} {train} engine tp{engine_tp} ep{engine_ep} rank{r}: {name}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("train", ["tp2", "tp2pp2", "tp2ep2", "pp2vpp2", "pp2uneven"])
def test_hf_megatron_hf_round_trip_is_identical(arch, train):
    t = TRAIN[train]
    if t.ep > 1 and not _moe(arch):
        pytest.skip("EP needs experts")
    layout = model_layout(tiny_config(arch))
    hf = random_hf_state(layout, seed=1)
    mcore = to_megatron(layout, hf, t)
    back = reshard_in_memory(build_plan(layout, t, HFLayout()), mcore, dtype=torch.float32, backend="torch")
    assert {k[2] for k in back} == set(hf)
    for (_, _, name), v in back.items():
        assert torch.equal(v, hf[name]), name


def test_bf16_cast_and_padding_rows_are_zero():
    layout = model_layout(tiny_config("qwen2"))
    hf = random_hf_state(layout)
    mcore = to_megatron(layout, hf, MegatronLayout(tp=2))
    got = reshard_in_memory(build_plan(layout, MegatronLayout(tp=2), SGLangLayout(tp=2)), mcore,
                            dtype=torch.bfloat16, backend="torch")
    emb = got[(1, 0, "model.embed_tokens.weight")]  # vocab 101 padded to 128: rank 1 holds rows 64..127
    assert emb.dtype == torch.bfloat16 and emb.shape == (64, 64)
    assert torch.equal(emb[: 101 - 64], hf["model.embed_tokens.weight"][64:].to(torch.bfloat16))
    assert not emb[101 - 64:].any()


@pytest.mark.parametrize("bad, message", [
    (dict(tp=3), "query groups"),
    (dict(dp=4, ep=4, tp=1), "not divisible by expert parallel size"),
])
def test_bad_parallel_sizes_raise_one_clear_error(bad, message):
    layout = model_layout(tiny_config("qwen3_moe", num_experts=6))
    with pytest.raises(LayoutError, match=message):
        build_plan(layout, HFLayout(), MegatronLayout(**bad))


def test_engine_tp_not_dividing_heads_is_refused():
    layout = model_layout(tiny_config("llama", num_key_value_heads=2, vocab_size=150))
    with pytest.raises(LayoutError, match=r"L0.qkv on the sglang side: attention heads \(8\)"):
        build_plan(layout, MegatronLayout(), SGLangLayout(tp=3))


def test_tied_qwen3_moe_still_gets_an_sglang_lm_head():
    cfg = tiny_config("qwen3_moe", tie_word_embeddings=True)
    layout = model_layout(cfg)
    hf = random_hf_state(layout)
    assert "lm_head.weight" not in hf
    mcore = to_megatron(layout, hf, MegatronLayout(tp=2))
    got = reshard_in_memory(build_plan(layout, MegatronLayout(tp=2), SGLangLayout(tp=2)), mcore,
                            dtype=torch.float32, backend="torch")
    for r in range(2):
        want = sglang_rank_params(hf, cfg, r, 2)
        assert torch.equal(got[(r, 0, "lm_head.weight")], want["lm_head.weight"])


def test_qwen3_moe_with_dense_layers_is_refused_for_sglang():
    layout = model_layout(tiny_config("qwen3_moe", mlp_only_layers=[0]))
    build_plan(layout, HFLayout(), MegatronLayout())  # converters are fine
    with pytest.raises(LayoutError, match="every Qwen3-MoE layer sparse"):
        build_plan(layout, MegatronLayout(), SGLangLayout(tp=1))


def test_expert_bias_stays_float32_in_a_bf16_sync():
    from mtrain.reshard.executor import Executor
    cfg = tiny_config("deepseek_v3")
    layout = model_layout(cfg)
    hf = random_hf_state(layout)
    mcore = to_megatron(layout, hf, MegatronLayout())
    ex = Executor(build_plan(layout, MegatronLayout(), SGLangLayout(tp=1)), 0,
                  lambda ref: mcore[(ref.rank, ref.chunk, ref.name)], dtype=torch.bfloat16, backend="torch")
    seen = {}
    for bucket in ex.stream():
        for name, t in bucket[0]:
            seen[name] = (t.dtype, t.clone())
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert seen[name][0] == torch.float32 and torch.equal(seen[name][1], hf[name])
    assert seen["model.layers.1.mlp.experts.w13_weight"][0] == torch.bfloat16
