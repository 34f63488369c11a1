"""The sync simulator: the full DeepSeek-V3 671B plan (no tensors) writes exactly the model's bytes, counted
here from the architecture's formulas; link accounting checked by hand on a tiny model; uneven pipeline
stages against megatron-core's own layer offsets; the CLI and its errors."""
import json
from pathlib import Path

import pytest
import torch

from mtrain.layouts import LayoutError, model_layout
from mtrain.reshard.placement import MegatronLayout, SGLangLayout
from mtrain.reshard.simulate import (CONFIGS, Hardware, RankStats, SimulationError, 
                                     link_times, main, parse_sizes, simulate, summarize, training_layout)
from mtrain.tiny_configs import tiny_config

DSV3 = json.loads(Path(CONFIGS["deepseek_v3"]).read_text())


def deepseek_v3_params(c: dict, engine_tp: int) -> tuple[int, int]:
    """(main-model parameters, parameters one engine of `engine_tp` ranks holds in total), from the formulas.

    SGLang replicates on every rank: the norms, the fused q_a/kv_a down-projection, the router and its bias;
    everything else is split exactly once over the engine (heads, rows, vocabulary, experts by EP).
    """
    V, H, L = c["vocab_size"], c["hidden_size"], c["num_hidden_layers"]
    heads, ql, kl = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    E, Im, I, dense = c["n_routed_experts"], c["moe_intermediate_size"], c["intermediate_size"], c["first_k_dense_replace"]
    attn_replicated = 2 * H + (ql + kl + rope) * H + ql + kl
    attn_split = heads * (nope + rope) * ql + heads * (nope + vd) * kl + H * heads * vd
    moe_replicated = E * H + E
    moe_split = E * 3 * H * Im + c["n_shared_experts"] * 3 * H * Im
    replicated = H + L * attn_replicated + (L - dense) * moe_replicated
    split = 2 * V * H + L * attn_split + dense * 3 * H * I + (L - dense) * moe_split
    return replicated + split, split + engine_tp * replicated


def test_config_is_the_release():
    assert (DSV3["num_hidden_layers"], DSV3["hidden_size"], DSV3["n_routed_experts"], DSV3["vocab_size"]) == \
           (61, 7168, 256, 129280)
    main_params, _ = deepseek_v3_params(DSV3, 1)
    assert 671.0e9 < main_params < 671.1e9  # "671B main model weights" in the release notes


def test_full_scale_plan_writes_exactly_the_model():
    train = training_layout(DSV3, parse_sizes("tp=1,pp=16,ep=32", "train", ("tp", "pp", "ep")), 512)
    assert (train.dp, train.first_stage_layers, train.last_stage_layers) == (32, 3, 2)
    engine = SGLangLayout(tp=8, ep=8)
    rep = simulate(DSV3, train, engine, engine_ids=[5], bucket_bytes=2 << 30)
    main_params, engine_params = deepseek_v3_params(DSV3, engine.tp)
    assert rep.model_bytes == 2 * main_params
    assert rep.engine_written == 2 * engine_params
    ranks = rep.per_engine_rank[0]
    assert sum(s.written for s in ranks.values()) == 2 * engine_params
    for s in ranks.values():
        assert s.local + s.received + s.zero == s.written
    assert sum(s.sent for s in rep.per_gpu.values()) == sum(s.received for s in rep.per_gpu.values())
    # Engine 5 sits on node 5 = training ranks 40..47, all in pipeline stage 1 (layers 3..6).
    assert all(s.local > 0 for s in ranks.values())
    summary = summarize(rep, Hardware())
    assert summary["engine_weights_per_gpu_max"] > 141e9  # bf16 TP8 does not fit one H200: the doc says so
    assert summary["predicted_s"]["overlap"] >= summary["predicted_s"]["ingress"] > 0
    assert summary["baseline_s"]["ingress"] > summary["predicted_s"]["ingress"]


def test_uneven_stages_match_megatron_core_offsets():
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = TransformerConfig(num_layers=61, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=16,
                            num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=2,
                            pipeline_dtype=torch.bfloat16)
    want = [get_transformer_layer_offset(cfg, pp_rank=r) for r in range(16)]
    counts = MegatronLayout(pp=16, first_stage_layers=3, last_stage_layers=2).stage_layers(61)
    assert [sum(counts[:r]) for r in range(16)] == want and sum(counts) == 61
    layout = model_layout(DSV3, mtp=False)
    uneven = MegatronLayout(pp=16, dp=2, ep=2, first_stage_layers=3, last_stage_layers=2)
    by_key = layout.by_key()
    assert uneven.stage_of(layout, by_key["L2.input_norm"]) == (0, 0, 2)
    assert uneven.stage_of(layout, by_key["L3.input_norm"]) == (1, 0, 0)
    assert uneven.stage_of(layout, by_key["L60.input_norm"]) == (15, 0, 1)
    with pytest.raises(LayoutError, match="middle layers do not divide"):
        MegatronLayout(pp=16, first_stage_layers=4, last_stage_layers=2).check(layout)


def tiny_llama_run(bucket_bytes):
    cfg = tiny_config("llama")  # 4 layers, hidden 64, 8 heads of 16, 2 KV heads, inter 96, vocab 101, tied
    train = MegatronLayout(pp=2, dp=2)  # ranks 0,1: stage 0 (layers 0,1, embedding); 2,3: stage 1
    hw = Hardware(gpus_per_node=2)
    return simulate(cfg, train, SGLangLayout(tp=2), hw=hw, bucket_bytes=bucket_bytes), hw


def test_tiny_link_accounting_by_hand():
    rep, _ = tiny_llama_run(1 << 30)
    # Engine-side elements of one layer over both ranks: 2 norms x 64 on each rank, qkv (128+2*32) x 64,
    # o 64 x 128, gate_up 192 x 64, down 64 x 96, each split once.
    layer = 2 * 2 * 64 + 192 * 64 + 64 * 128 + 192 * 64 + 64 * 96
    stage1 = 2 * layer + 2 * 64  # layers 2,3 and the final norm on both ranks
    stage0 = 2 * layer + 101 * 64  # layers 0,1 and the embedding (27 padding rows are zero-filled)
    e0, e1 = rep.per_engine_rank
    assert sum(s.recv_ib for s in e0.values()) == 2 * stage1 and sum(s.local for s in e0.values()) == 2 * stage0
    assert sum(s.recv_ib for s in e1.values()) == 2 * stage0 and sum(s.local for s in e1.values()) == 2 * stage1
    assert all(s.recv_nvlink == 0 for s in (*e0.values(), *e1.values()))
    assert sum(s.zero for s in e0.values()) == 2 * 27 * 64
    # One bucket: each GPU fills once for its engine rank and packs once for the peer engine rank it feeds.
    for g, s in rep.per_gpu.items():
        assert (s.fill_launches, s.pack_launches, s.buckets) == (1, 1, 1), g


def test_tiny_launches_per_bucket():
    rep, _ = tiny_llama_run(1)  # every destination tensor is its own bucket
    names = 4 * 6 + 2  # per layer: 2 norms, qkv, o, gate_up, down; plus embedding and final norm
    s0 = rep.per_gpu[0]
    assert s0.buckets == s0.fill_launches == names
    assert rep.per_gpu[2].pack_launches == 2 * 6 + 1  # feeds engine 0's rank 0 stage 1's 13 tensors
    assert rep.per_gpu[0].pack_launches == 2 * 6 + 1  # feeds engine 1's rank 0 layers 0,1 and the embedding


def test_link_model_arithmetic():
    hw = Hardware(hbm_bw=1e12, nvlink_bw=1e11, ib_bw=1e10, launch_s=1e-3, per_bucket_s=0)
    s = RankStats(written=10e9, local=4e9, recv_nvlink=2e9, recv_ib=4e9, sent_ib=1e9, fill_launches=3, pack_launches=2,
                  buckets=7)
    t = link_times(s, hw)
    assert t["hbm"] == pytest.approx((2 * 4e9 + 3 * 1e9 + 3 * 6e9) / 1e12)
    assert t["ib"] == pytest.approx(0.4) and t["nvlink"] == pytest.approx(0.02) and t["launch"] == pytest.approx(5e-3)
    assert t["overlap"] == pytest.approx(0.405) and t["ingress"] == pytest.approx(0.4)
    assert t["serial"] == pytest.approx(t["hbm"] + 0.02 + 0.4 + 5e-3)
    slow_calls = link_times(s, Hardware(hbm_bw=1e12, nvlink_bw=1e11, ib_bw=1e10, launch_s=1e-3, per_bucket_s=0.01))
    assert slow_calls["overlap"] == pytest.approx(0.405 + 7 * 0.01)


def test_cli_runs_and_writes_json(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(tiny_config("deepseek_v3")))
    out = tmp_path / "sim.json"
    rc = main(["--config", str(cfg), "--train", "tp=1,pp=2,ep=2", "--world", "4", "--engine", "tp=2,ep=2",
               "--gpus-per-node", "2", "--bucket-mb", "1", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "predicted sync" in text and "full-gather baseline" in text
    data = json.loads(out.read_text())
    assert data["engines_planned"] == 2 and len(data["per_gpu"]) == 4


@pytest.mark.parametrize("args, message", [
    (["--train", "tp=x"], "--train: tp='x' is not an integer"),
    (["--train", "zz=2"], "--train: 'zz=2' must look like NAME=INT"),
    (["--engine", "tp=8", "--engines", "100"], "only 64 engines of tp 8 fit on 512 GPUs"),
    (["--world", "500"], "--world 500 is not divisible by tp\\*pp\\*cp"),
    (["--config", "nope"], "no such config"),
])
def test_cli_bad_input_is_one_clear_error(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    import re
    assert re.search(message, err), err


def test_parse_sizes_refuses_zero():
    with pytest.raises(SimulationError, match="tp must be >= 1"):
        parse_sizes("tp=0", "engine", ("tp", "ep"))
