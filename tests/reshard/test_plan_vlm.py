"""Qwen2.5-VL through the planner: HF -> Megatron (TP/PP layouts, vision tower replicated on the first stage)
-> SGLang (engine TP 1/2/4) equals SGLang's own slicing of the full HF tensors (sglang_reference, written from
its loaders, not from the tables), padded vision MLP included; HF -> Megatron -> HF is bit-identical."""
import pytest
import torch

from converters.mcore_io import hf_expected
from mtrain.layouts import LayoutError, model_layout
from mtrain.reshard.local import reshard_in_memory
from mtrain.reshard.placement import HFLayout, MegatronLayout, SGLangLayout
from mtrain.reshard.planner import build_plan
from mtrain.tiny_configs import tiny_config

from sglang_reference import sglang_rank_params, sglang_vision_params

TRAIN = {"tp1": MegatronLayout(), "tp2": MegatronLayout(tp=2), "tp2pp2": MegatronLayout(tp=2, pp=2),
         "pp2vpp": MegatronLayout(pp=2, vpp=1), "dp2": MegatronLayout(dp=2)}


def random_state(layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in hf_expected(layout).items()}


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_5_vl_tied"])
@pytest.mark.parametrize("train", list(TRAIN))
def test_vlm_megatron_to_sglang_matches_sglang_slicing(arch, train):
    t = TRAIN[train]
    cfg = tiny_config(arch)
    layout = model_layout(cfg)
    hf = random_state(layout)
    mcore = reshard_in_memory(build_plan(layout, HFLayout(), t), lambda ref: hf[ref.name], dtype=torch.float32,
                              backend="torch")
    for name, v in mcore.items():  # the vision tower lives on pipeline stage 0 only, whole on every TP rank
        if ".vision." in f".{name[2]}":
            assert t.coords[name[0]]["pp"] == 0 and torch.equal(v, hf[name[2].replace("vision.", "visual.", 1)])
    for engine_tp in (1, 2, 4):
        plan = build_plan(layout, t, SGLangLayout(tp=engine_tp), colocate=lambda r: r % t.world)
        got = reshard_in_memory(plan, mcore, dtype=torch.float32, backend="torch")
        for r in range(engine_tp):
            want = {**sglang_rank_params(hf, cfg, r, engine_tp), **sglang_vision_params(hf, cfg, r, engine_tp)}
            mine = {k[2]: v for k, v in got.items() if k[0] == r}
            assert set(mine) == set(want), set(mine) ^ set(want)
            for name, ref in want.items():
                assert mine[name].shape == ref.shape, (name, mine[name].shape, ref.shape)
                assert torch.equal(mine[name], ref), f"{arch} {train} engine tp{engine_tp} rank{r}: {name}"


@pytest.mark.parametrize("train", ["tp2", "tp2pp2"])
def test_vlm_hf_megatron_hf_round_trip_is_identical(train):
    t = TRAIN[train]
    layout = model_layout(tiny_config("qwen2_5_vl"))
    hf = random_state(layout, seed=1)
    mcore = reshard_in_memory(build_plan(layout, HFLayout(), t), lambda ref: hf[ref.name], dtype=torch.float32,
                              backend="torch")
    back = reshard_in_memory(build_plan(layout, t, HFLayout()), mcore, dtype=torch.float32, backend="torch")
    assert {k[2] for k in back} == set(hf)
    for (_, _, name), v in back.items():
        assert v.shape == hf[name].shape and torch.equal(v, hf[name]), name


def test_padded_vision_mlp_rows_are_zero_on_the_engine():
    cfg = tiny_config("qwen2_5_vl")  # vision intermediate 44 -> SGLang 48: engine tp 2 holds 24 + 24 rows each
    layout = model_layout(cfg)
    hf = random_state(layout)
    got = reshard_in_memory(build_plan(layout, HFLayout(), SGLangLayout(tp=2)), lambda ref: hf[ref.name],
                            dtype=torch.float32, backend="torch")
    gu = got[(1, 0, "visual.blocks.0.mlp.gate_up_proj.weight")]
    assert gu.shape == (48, 32) and not gu[20:24].any() and not gu[44:48].any()
    assert torch.equal(gu[:20], hf["visual.blocks.0.mlp.gate_proj.weight"][24:])
    down = got[(1, 0, "visual.blocks.0.mlp.down_proj.weight")]
    assert down.shape == (32, 24) and not down[:, 20:].any()


def test_vision_heads_not_dividing_engine_tp_are_refused():
    cfg = tiny_config("qwen2_5_vl")
    cfg["vision_config"] = dict(cfg["vision_config"], num_heads=2, hidden_size=32)
    with pytest.raises(LayoutError, match="vision attention heads"):
        build_plan(model_layout(cfg), MegatronLayout(), SGLangLayout(tp=4))


def test_fp8_engine_for_a_vlm_is_refused():
    with pytest.raises(LayoutError, match="FP8 engine for a vision-language model"):
        build_plan(model_layout(tiny_config("qwen2_5_vl")), MegatronLayout(), SGLangLayout(tp=1, fp8=True))


def test_vision_output_width_must_match_text_hidden():
    cfg = tiny_config("qwen2_5_vl")
    cfg["vision_config"] = dict(cfg["vision_config"], out_hidden_size=48)
    with pytest.raises(LayoutError, match="out_hidden_size 48"):
        model_layout(cfg)


def test_nested_transformers5_config_gives_the_same_table():
    flat = tiny_config("qwen2_5_vl")
    text_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "rms_norm_eps", "rope_scaling", "max_position_embeddings")
    nested = {k: v for k, v in flat.items() if k not in text_keys}
    nested["text_config"] = {k: flat[k] for k in text_keys}
    a, b = model_layout(flat), model_layout(nested)
    assert [(w.key, w.shape, w.hf, w.sglang, w.megatron) for w in a.weights] == \
           [(w.key, w.shape, w.hf, w.sglang, w.megatron) for w in b.weights]


def _pull_sync_check(layout, cfg, hf, mcore, t, engine_tp, rank=0, only_local=True):
    from mtrain.reshard import pull_protocol as P
    from mtrain.reshard.executor import Executor
    from mtrain.reshard.pull import PullPlan
    from test_pull import engine_params, run_sync
    plan = build_plan(layout, t, SGLangLayout(tp=engine_tp), colocate=lambda r: 0)
    ex = Executor(plan, rank, lambda ref: mcore[(ref.rank, ref.chunk, ref.name)], dtype=torch.float32,
                  src_everywhere=only_local, backend="torch", bucket_bytes=4096)
    pull = PullPlan(ex)
    params = {r: engine_params(plan, r, torch.float32) for r in range(engine_tp)} if rank == 0 else {}
    states = {r: P.PullState() for r in range(engine_tp)}
    run_sync(pull, params, states, P.PullSender(engine_tp), engine_tp)
    bad = []
    for r, got in params.items():
        want = {**sglang_rank_params(hf, cfg, r, engine_tp), **sglang_vision_params(hf, cfg, r, engine_tp)}
        assert set(got) == set(want)
        bad += [f"engine rank {r}: {n}" for n, v in want.items() if not torch.equal(got[n], v)]
    return bad


@pytest.mark.parametrize("train, engine_tp", [("tp2", 2), ("tp2pp2", 4)])
def test_vlm_pull_in_one_process_equals_sglang_slicing(train, engine_tp):
    t = TRAIN[train]
    cfg = tiny_config("qwen2_5_vl")
    layout = model_layout(cfg)
    hf = random_state(layout)
    mcore = reshard_in_memory(build_plan(layout, HFLayout(), t), lambda ref: hf[ref.name], dtype=torch.float32,
                              backend="torch")
    assert not _pull_sync_check(layout, cfg, hf, mcore, t, engine_tp)


def _pull_rank(rank, world, engine_tp):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = TRAIN["tp2pp2"]
    cfg = tiny_config("qwen2_5_vl")
    layout = model_layout(cfg)
    hf = random_state(layout)
    mcore = reshard_in_memory(build_plan(layout, HFLayout(), t), lambda ref: hf[ref.name], dtype=torch.float32,
                              backend="torch")
    mine = {k: v for k, v in mcore.items() if k[0] == rank}  # only this rank's shards: the rest travels
    bad = _pull_sync_check(layout, cfg, hf, mine, t, engine_tp, rank=rank, only_local=False)
    dist.destroy_process_group()
    return bad


def test_vlm_pull_over_gloo_ranks_equals_sglang_slicing():
    from mtrain.dist import run_on_ranks
    for bad in run_on_ranks(_pull_rank, 4, 2, timeout=300):
        assert not bad, bad[:5]


def test_release_shaped_7b_plan_shapes():
    """Qwen2.5-VL-7B's shape (examples/qwen2_5_vl/qwen2_5_vl_7b_config.json, the release's config.json): the vision
    MLP's 3420 is padded to 3424 in SGLang, heads 16 split over engine TP 4; training TP 4, PP 2 (the tower on
    stage 0 only); planned from shapes alone."""
    import json
    from pathlib import Path
    cfg = json.loads((Path(__file__).resolve().parents[2] / "examples/qwen2_5_vl/qwen2_5_vl_7b_config.json").read_text())
    layout = model_layout(cfg)
    plan = build_plan(layout, MegatronLayout(tp=4, pp=2), SGLangLayout(tp=4))
    shapes = {k[2]: ref.shape for k, ref in plan.dst_tensors.items() if k[0] == 3}
    assert shapes["visual.blocks.0.mlp.gate_up_proj.weight"] == (2 * 3424 // 4, 1280)
    assert shapes["visual.blocks.31.mlp.down_proj.weight"] == (1280, 3424 // 4)
    assert shapes["visual.blocks.0.attn.qkv_proj.weight"] == (3 * 1280 // 4, 1280)
    assert shapes["visual.patch_embed.proj.weight"] == (1280, 3, 2, 14, 14)
    assert shapes["visual.merger.mlp.0.weight"] == (5120 // 4, 5120)
    assert shapes["model.layers.27.self_attn.qkv_proj.weight"] == ((28 + 2 * 4) * 128 // 4, 3584)
    assert shapes["lm_head.weight"] == (152064 // 4, 3584)
    src = {k[2] for k in plan.src_tensors if k[0] in (4, 5, 6, 7)}  # pipeline stage 1 holds no vision weights
    assert src and not any(n.startswith("vision.") for n in src)
    vision = sum(w.shape2d[0] * w.shape2d[1] for w in layout.weights if w.key.startswith("V"))
    assert 0.6e9 < vision < 0.7e9, vision  # the release's 0.67 B-parameter vision tower
