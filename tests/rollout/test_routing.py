"""Routed experts on the rollout side: the compact per-token array, SGLang's payload, the CPU reference engine's
capture from its own MoE blocks (checked against the model's full-sequence gate), partial-rollout resumes that keep
each token's row, and the trainer batch that carries them."""
from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mtrain.rollout.protocol import Completion, EngineError, Request, SamplingParams
from mtrain.rollout.routing import (RoutingError, RoutingShape, batch_routing, decode_sglang, merge_resumed,
                                    routing_dtype, routing_shape, set_disagreement)
from mtrain.tiny_configs import tiny_config

REPO = Path(__file__).resolve().parents[2]


def test_dtype_follows_the_expert_count():
    assert routing_dtype(8) == torch.uint8 and routing_dtype(256) == torch.uint8
    assert routing_dtype(257) == torch.int16 and routing_dtype(32768) == torch.int16
    assert routing_dtype(32769) == torch.int32
    with pytest.raises(RoutingError):
        routing_dtype(0)


def test_shapes_from_the_architecture_tables():
    q = routing_shape(tiny_config("qwen3_moe"))
    assert (q.num_layers, q.top_k, q.num_experts, q.moe_layers) == (4, 2, 4, (0, 1, 2, 3))
    d = routing_shape(tiny_config("deepseek_v3"))  # first_k_dense_replace=1, one MTP layer (not routed here)
    assert (d.num_layers, d.top_k, d.num_experts, d.moe_layers) == (4, 4, 8, (1, 2, 3))
    full = routing_shape(json.loads((REPO / "examples/deepseek_v3/full/config.json").read_text()))
    assert (full.num_layers, full.top_k, full.num_experts, full.moe_layers[0]) == (61, 8, 256, 3)
    assert full.bytes_per_token == 488 and full.sglang_bytes_per_token == 1952  # uint8 vs SGLang's int32
    assert routing_shape(tiny_config("llama")) is None


def _payload(arr: np.ndarray) -> str:
    return base64.b64encode(arr.astype(np.int32).tobytes()).decode()


def test_decode_sglang_payload_and_its_errors():
    shape = RoutingShape(num_layers=3, top_k=4, num_experts=16, moe_layers=(1, 2))
    arr = np.random.default_rng(0).integers(0, 16, (46, 3, 4))
    arr[:, 0] = 0  # the dense layer: zero rows, as SGLang's buffers
    got = decode_sglang(_payload(arr), shape, 46, "req")
    assert got.dtype == torch.uint8 and got.shape == (46, 3, 4) and (got.numpy() == arr).all()
    with pytest.raises(RoutingError, match="cover 45 tokens, expected 46"):
        decode_sglang(_payload(arr[:45]), shape, 46, "req")
    with pytest.raises(RoutingError, match="do not split into rows"):
        decode_sglang(_payload(arr.ravel()[:-1]), shape, 46, "req")
    with pytest.raises(RoutingError, match="not base64"):
        decode_sglang("!!not base64!!", shape, 46, "req")
    bad = arr.copy()
    bad[7, 2, 1] = 16
    with pytest.raises(RoutingError, match="expert id 16 at token 7, layer 2"):
        decode_sglang(_payload(bad), shape, 46, "req")
    wide = RoutingShape(num_layers=2, top_k=2, num_experts=300, moe_layers=(0, 1))  # int16 storage
    neg = np.full((3, 2, 2), 5)
    neg[1, 0, 0] = -1
    with pytest.raises(RoutingError, match="expert id -1"):
        decode_sglang(_payload(neg), wide, 3, "req")


def test_completion_from_sglang_output_with_routed_experts():
    from mtrain.rollout.sglang_wire import completion_from_output, engine_server_args
    assert engine_server_args("/m", tp_size=1, mem_fraction_static=0.3, base_gpu_id=0, load_format="dummy",
                              random_seed=0, routed_experts=True)["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in engine_server_args("/m", tp_size=1, mem_fraction_static=0.3,
                                                                    base_gpu_id=0, load_format="dummy", random_seed=0)
    shape = RoutingShape(num_layers=2, top_k=2, num_experts=4, moe_layers=(0, 1))
    req = Request("a", [5, 6, 7])
    arr = np.random.default_rng(1).integers(0, 4, (4, 2, 2))  # 3 prompt + 2 output - 1
    out = {"output_ids": [8, 9], "meta_info": {"output_token_logprobs": [[-0.5, 8, None], [-0.25, 9, None]],
                                                "finish_reason": {"type": "length"}, "weight_version": "3",
                                                "routed_experts": _payload(arr)}}
    c = completion_from_output(req, out, 0, routing=shape)
    assert c.routed_experts.shape == (4, 2, 2) and (c.routed_experts.numpy() == arr).all()
    assert completion_from_output(req, out, 0).routed_experts is None  # replay off: ignored
    missing = {**out, "meta_info": {k: v for k, v in out["meta_info"].items() if k != "routed_experts"}}
    with pytest.raises(EngineError, match="no routed experts"):
        completion_from_output(req, missing, 0, routing=shape)
    aborted = {**missing, "meta_info": {**missing["meta_info"], "finish_reason": {"type": "abort"}}}
    assert completion_from_output(req, aborted, 0, routing=shape).routed_experts is None


def _hf_own_routing(model, arch: str, ids: list[int]) -> dict[int, torch.Tensor]:
    """Per MoE layer, the expert set the model's own gate picks for every token of one full-sequence forward."""
    picked, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if not hasattr(mlp, "experts"):
            continue

        def hook(block, args, i=i):
            x = args[0].reshape(-1, args[0].shape[-1])
            if arch == "qwen3_moe":
                picked[i] = block.gate(x)[2]
            else:
                picked[i] = block.route_tokens_to_experts(block.gate(x))[0]
        hooks.append(mlp.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return picked


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_reference_engine_records_its_own_routing(arch):
    from mtrain.rollout.reference_engine import ReferenceEngine
    cfg = dict(tiny_config(arch), num_nextn_predict_layers=0)
    engine = ReferenceEngine(cfg, record_routing=True)
    reqs = [Request(f"r{i}", [3 + i, 4, 5, 6 + i][: 2 + i], SamplingParams(max_new_tokens=5 + i, seed=i))
            for i in range(3)]
    outs = engine.generate(reqs)
    shape = routing_shape(cfg)
    for c in outs:
        seq = c.prompt_ids + c.output_ids
        assert c.routed_experts.shape == (len(seq) - 1, shape.num_layers, shape.top_k)
        assert c.routed_experts.dtype == torch.uint8
        own = _hf_own_routing(engine._model, arch, seq[:-1])  # the incremental decode saw these tokens
        for layer in range(shape.num_layers):
            if layer in shape.moe_layers:
                assert not set_disagreement(c.routed_experts[:, layer], own[layer]).any(), (c.rid, layer)
            else:
                assert (c.routed_experts[:, layer] == 0).all()
    plain = ReferenceEngine(cfg).generate(reqs[:1])[0]
    assert plain.routed_experts is None and plain.output_ids == outs[0].output_ids
    with pytest.raises(EngineError, match="no MoE layers"):
        ReferenceEngine(tiny_config("llama"), record_routing=True)


def test_completion_refuses_routing_of_the_wrong_length():
    with pytest.raises(ValueError, match="routed experts cover 4 tokens"):
        Completion("a", [1, 2], [3, 4], [0.0, 0.0], "stop", 0, routed_experts=torch.zeros(4, 2, 2, dtype=torch.uint8))


def test_partial_resume_takes_the_resumed_requests_routing():
    """Abort a sample mid-way on the reference engine, resume it (partial rollout): the resumed request re-feeds the
    prompt and the kept tokens and its rows replace the held ones (its generated tokens were sampled from that
    forward), and the whole is prompt + output - 1 rows."""
    from mtrain.rollout import partial
    from mtrain.rollout.reference_engine import ReferenceEngine
    cfg = dict(tiny_config("qwen3_moe"))
    engine = ReferenceEngine(cfg, record_routing=True, decode_delay_s=0.02)
    group = partial.new_group(0, 0, [5, 6, 7, 8], 1, base_seed=3)
    params = SamplingParams(max_new_tokens=24, seed=0)
    fut = engine.submit(partial.resume_request(group, 0, params, "s0"))
    while not any(n >= 4 for n in engine.active_requests().values()):
        time.sleep(0.01)
    engine.abort()
    first = fut.result()
    assert first.finish_reason == "abort" and 4 <= len(first.output_ids) < 24
    partial.apply(group, 0, first)
    assert group.samples[0].routing.shape[0] == 4 + len(first.output_ids) - 1
    second = engine.generate([partial.resume_request(group, 0, params, "s1")])[0]
    kept = 4 + len(first.output_ids) - 1
    assert second.routed_experts_start == 0  # the resume asks for every row
    partial.apply(group, 0, second)
    (c,) = group.completions()
    assert c.routed_experts.shape[0] == len(c.prompt_ids) + len(c.output_ids) - 1
    assert torch.equal(c.routed_experts, second.routed_experts)
    # same weights here, so the re-fed prefix routes as it did the first time
    assert torch.equal(c.routed_experts[:kept], first.routed_experts)
    restored = partial.from_state(partial.to_state([group]))[0]  # the buffer is checkpointed with its routing
    assert torch.equal(restored.samples[0].routing, c.routed_experts)
    engine.shutdown()


def test_merge_resumed_edges():
    a, b = torch.ones(5, 2, 2, dtype=torch.uint8), torch.zeros(9, 2, 2, dtype=torch.uint8)
    assert merge_resumed(a, b, 9)[:5].eq(1).all() and merge_resumed(a, b, 9)[5:].eq(0).all()
    assert torch.equal(merge_resumed(None, b, 9), b)  # the aborted request brought none: the resumed one re-fed all
    assert merge_resumed(a, None, 9) is None
    with pytest.raises(RoutingError, match="covers 9 tokens, the sample has 10"):
        merge_resumed(a, b, 10)


def test_batch_carries_routing_and_fills_unrecorded_positions():
    from mtrain.trainer.batch import RolloutBatch, build_batch
    from mtrain.trainer.packing import make_pack, pack, unpack
    shape = RoutingShape(num_layers=2, top_k=2, num_experts=4, moe_layers=(0, 1))
    g = torch.Generator().manual_seed(0)
    comps = [Completion(f"c{i}", [1] * p, [2] * r, [-1.0] * r, "stop", 0,
                        routed_experts=torch.randint(0, 4, (p + r - 1, 2, 2), generator=g).to(torch.uint8))
             for i, (p, r) in enumerate([(3, 2), (2, 5), (4, 1)])]
    b = build_batch(comps, [0.0, 1.0, 0.5], pad_id=0, routing=shape)
    assert b.routed_experts.shape == (3, 7, 2, 2) and b.routed_experts.dtype == torch.uint8
    for i, c in enumerate(comps):
        n = len(c.prompt_ids) + len(c.output_ids)
        assert torch.equal(b.routed_experts[i, :n - 1], c.routed_experts)
        assert (b.routed_experts[i, n - 1:] == shape.filler()).all()  # last token and padding
    sel = b.select(torch.tensor([2, 0]))
    assert torch.equal(sel.routed_experts[1], b.routed_experts[0])
    assert RolloutBatch.concat([sel, sel]).routed_experts.shape == (4, 7, 2, 2)
    assert build_batch(comps, [0.0] * 3, pad_id=0).routed_experts is None  # replay off
    assert build_batch(comps, [0.0] * 3, pad_id=0).select(slice(0, 2)).routed_experts is None
    pk = make_pack(torch.tensor([0, 1]), b.seq_lens[:2])
    packed = pack(pk, b.routed_experts, 7, "routed_experts")
    assert packed.shape == (pk.total, 2, 2)
    assert torch.equal(unpack(pk, packed, 7, 7)[0, :5], b.routed_experts[0, :5])
    comps[1].routed_experts = None
    with pytest.raises(RoutingError, match="sample 'c1': no routed experts"):
        build_batch(comps, [0.0] * 3, pad_id=0, routing=shape)
    with pytest.raises(RoutingError, match="sample 'x'"):
        batch_routing(shape, 4, [("x", 3, torch.zeros(3, 2, 2, dtype=torch.uint8), True)])
