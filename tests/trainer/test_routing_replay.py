"""Rollout routing replay (R3) on megatron-core, against an independent float64 forward.

- With algo.routing_replay=rollout the trainer's MoE layers use exactly the given experts: random expert ids (not
  what any router would pick) in the batch, Megatron's logprobs (float32, padded and packed micro-batches) equal a
  float64 transformers forward whose MoE blocks take those ids as input (routing_replay_worker.py), on Qwen3-MoE and
  DeepSeek-V3 tiny at EP2, PP2 (and PP2 x VPP2), TP2 x EP2. Where the layout trains (not TP2 without sequence
  parallelism), the training forward's PPO ratio against those logprobs is 1 and full activation recompute gives the
  same gradients (the backward's recompute replays the same micro-batch's ids; without that, PP2 differs by 0.1).
- A trainer whose routers choose differently from the engine's (perturbed expert bias / a tie broken the other way)
  scores the engine's tokens with a large gap without replay, and within 1e-5 of the engine's logprobs with it.
- Bad replay data (wrong layer count, wrong token count, an expert id out of range, none at all) fails with one clear
  error before any forward runs.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mtrain.dist import run_on_ranks

LP_TOL = 1e-5
SLOW = pytest.mark.slow
LAYOUTS = {  # id: (arch, ranks, parallel sizes, train checks)
    "qwen3_moe-pp2": ("qwen3_moe", 2, {"pp": 2}, True),
    "deepseek_v3-ep2": ("deepseek_v3", 2, {"ep": 2}, True),
    "deepseek_v3-tp2ep2": pytest.param(("deepseek_v3", 4, {"tp": 2, "ep": 2}, False), marks=SLOW),  # 4 ranks: ~30 s
    "qwen3_moe-ep2": pytest.param(("qwen3_moe", 2, {"ep": 2}, True), marks=SLOW),
    "deepseek_v3-pp2": pytest.param(("deepseek_v3", 2, {"pp": 2}, True), marks=SLOW),
    "qwen3_moe-tp2ep2": pytest.param(("qwen3_moe", 4, {"tp": 2, "ep": 2}, False), marks=SLOW),
    "qwen3_moe-pp2vpp2": pytest.param(("qwen3_moe", 2, {"pp": 2, "vpp": 2}, True), marks=SLOW),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    root = tmp_path_factory.mktemp("hf")
    return {arch: write_tiny_hf(arch, root / arch, seed=0) for arch in ("qwen3_moe", "deepseek_v3")}


@pytest.mark.parametrize("case", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_replay_uses_exactly_the_recorded_experts(tiny, case):
    from routing_replay_worker import forced_reference_logprobs, make_batch, replay_equals_reference
    arch, world, layout, train = case
    hf = tiny[arch]
    ref = forced_reference_logprobs(str(hf), make_batch(json.loads((hf / "config.json").read_text())))
    results = run_on_ranks(replay_equals_reference, world, str(hf), layout, ref, train, timeout=600)
    last = [r for r in results if r["last"]]
    assert last, "no last pipeline stage reported"
    for r in last:
        assert r["lp_padded_vs_ref"] <= LP_TOL and r["lp_packed_vs_ref"] <= LP_TOL, r
        if train:
            assert r["ratio_dev"] <= LP_TOL, r
    if train:
        for r in results:
            assert r["grad_max_abs"] > 0, r
            assert r["grad_recompute_diff"] <= 1e-6 * max(1.0, r["grad_max_abs"]), r


def _engine_completions(hf: Path, n: int = 6):
    """The CPU reference engine (float32) on the checkpoint, recording routed experts from its own MoE blocks."""
    from mtrain.rollout.protocol import Request, SamplingParams
    from mtrain.rollout.reference_engine import ReferenceEngine
    engine = ReferenceEngine.from_pretrained(str(hf), record_routing=True)
    g = torch.Generator().manual_seed(5)
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    reqs = [Request(f"r{i}", torch.randint(3, vocab, (3 + i,), generator=g).tolist(),
                    SamplingParams(max_new_tokens=8, seed=i)) for i in range(n)]
    out = engine.generate(reqs)
    engine.shutdown()
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_replay_restores_engine_logprobs_under_a_perturbed_router(tmp_path, arch):
    from routing_replay_worker import perturbed_copy, perturbed_trainer, tie_router_rows
    from mtrain.tiny_hf import write_tiny_hf
    engine_hf = write_tiny_hf(arch, tmp_path / "engine", seed=1)
    if arch == "qwen3_moe":
        tie_router_rows(engine_hf)
    trainer_hf = perturbed_copy(engine_hf, tmp_path / "trainer", arch)
    completions = _engine_completions(engine_hf)
    assert all(c.routed_experts is not None for c in completions)
    (res,) = run_on_ranks(perturbed_trainer, 1, str(trainer_hf), completions, timeout=600)
    assert res["gap_off"] > 1e-3, res  # the routing flips change the tokens' logprobs
    assert res["metrics_rollout"]["routing/disagreement"] > 0.02, res  # measured from the replayed pass itself
    assert res["gap_rollout"] <= LP_TOL, res
    assert res["metrics_off"] == {}, res


BAD = {"layers": "layers", "tokens": "do not match the batch", "expert_id": "expert id 250",
       "missing": "no routed experts"}


def test_bad_replay_data_fails_before_any_forward(tiny):
    from routing_replay_worker import bad_replay_data
    (res,) = run_on_ranks(bad_replay_data, 1, str(tiny["deepseek_v3"]), list(BAD), timeout=600)
    for what, needle in BAD.items():
        r = res[what]
        assert r["error"] is not None and r["error"].startswith("RoutingError"), (what, r)
        assert needle in r["error"], (what, r)
        assert r["forwards"] == 0, (what, r)
    assert res["good"]["error"] is None and res["good"]["forwards"] > 0, res  # nothing left half-fed: the next runs


def test_rl_loop_replays_the_engines_routing_through_partial_rollout(tiny, tmp_path):
    """Two GRPO steps on 2 ranks (EP2) with partial rollout: the reference engine records routing, aborted samples
    resume keeping theirs, every rank's batch carries it, the trainer replays it, and the step reports the metrics."""
    from routing_replay_worker import loop_steps
    extra = {"parallel.tp": 1, "parallel.ep": 2, "algo.routing_replay": "rollout", "rollout.partial": "true",
             "rollout.over_sample": 2.0, "train.steps": 2}
    records = run_on_ranks(loop_steps, 2, str(tiny["qwen3_moe"]), str(tmp_path / "run"), extra, timeout=600)
    for rec in records[0]:
        assert rec["routing/bytes_per_token"] == 4 * 2 * 1  # 4 layers x top-2, uint8
        # one int32 payload row per token, more where a resumed sample re-fed its tokens (all its rows come again)
        assert rec["routing/engine_bytes_per_token"] >= 4 * 2 * 4
        # float32 on both sides, so the trainer's own choice differs only on near-ties
        assert 0.0 <= rec["routing/disagreement"] < 0.01, rec
        # tokens of this step's weights (older ones are masked; a step may have none): a resumed sample's rows all
        # come from the request that sampled them, so its new tokens' logprobs match too (with the rows first
        # recorded kept, a prefix token routed otherwise under the new weights moved them by up to 1.6e-3)
        assert rec.get("logprob_diff/max_abs", 0.0) <= LP_TOL, rec
    for a, b in zip(*records):  # reduced over ranks
        assert {k: v for k, v in a.items() if k.startswith("routing/")} == \
            {k: v for k, v in b.items() if k.startswith("routing/")}


def test_trainer_mode_update_replays_the_scoring_pass(tiny):
    """algo.routing_replay=trainer at PP2 with full recompute: between the scoring pass and the update every router's
    expert bias moves (its choice changes, the weights of chosen experts do not); the update still uses the scoring
    pass's experts (PPO ratio 1), without replay it does not. An update with no scored pass left is refused."""
    from routing_replay_worker import trainer_mode
    results = run_on_ranks(trainer_mode, 2, str(tiny["deepseek_v3"]), {"pp": 2}, timeout=600)
    (last,) = [r for r in results if r["last"]]
    assert last["ratio_dev_off"] > 1e-3, last
    assert last["ratio_dev_trainer"] <= LP_TOL, last
    for r in results:
        assert r["second_update_off"] is None, r
        assert "no recorded scoring pass" in r["second_update_trainer"], r


def test_rollout_replay_with_padded_context_parallel_is_refused_before_work():
    from mtrain.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="needs packed micro-batches"):
        load_config(Path(__file__).resolve().parents[2] / "mtrain/configs/tiny_llama_grpo.yaml",
                    ["algo.routing_replay=rollout", "parallel.cp=2", "train.max_tokens_per_micro_batch=null"])


def test_multi_turn_trajectory_keeps_each_tokens_first_recorded_routing(tiny):
    """Two model turns with a tool result between them, on the reference engine recording its own router: the
    trajectory's rows are turn 1's request's for every token it fed or produced, and turn 2's request's for the rest
    (its prefill re-routes turn 1's tokens, which must not replace the rows they were sampled under); a tool result
    after the last turn was never fed, so its rows are the filler in the batch."""
    from mtrain.rollout import ReferenceEngine
    from mtrain.rollout.protocol import Request, SamplingParams
    from mtrain.rollout.routing import routing_shape
    from mtrain.rollout.trajectory import Segment, Trajectory, to_batch
    engine = ReferenceEngine.from_pretrained(str(tiny["qwen3_moe"]), record_routing=True)
    try:
        shape = routing_shape(json.loads((tiny["qwen3_moe"] / "config.json").read_text()))
        traj = Trajectory("t-", [Segment("prompt", [3, 17, 9, 24, 5])], reward=1.0)
        params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
        comps = []
        for turn in range(2):
            comp = engine.generate([Request(f"t-{turn}-", traj.tokens, params)])[0]
            traj.add_model_tokens(comp.output_ids, comp.logprobs, comp.weight_version)
            traj.record_routing(comp.routed_experts)
            comps.append(comp)
            traj.segments.append(Segment("env", [11, 12, 13]))  # a tool result (the last one is never fed)
        first = len(comps[0].prompt_ids) + len(comps[0].output_ids) - 1
        n_fed = len(comps[1].prompt_ids) + len(comps[1].output_ids)
        assert traj.routed_experts.shape[0] == n_fed - 1
        assert torch.equal(traj.routed_experts[:first], comps[0].routed_experts)
        assert torch.equal(traj.routed_experts[first:], comps[1].routed_experts[first:n_fed - 1])
        batch = to_batch([traj], pad_id=0, routing=shape)
        assert torch.equal(batch.routed_experts[0, :n_fed - 1], traj.routed_experts.to(shape.dtype))
        n = len(traj.tokens)
        assert torch.equal(batch.routed_experts[0, n_fed - 1:n - 1],
                           shape.filler().expand(n - n_fed, shape.num_layers, shape.top_k))
    finally:
        engine.shutdown()


def test_rl_loop_replays_the_engines_routing_of_multi_turn_trajectories(tmp_path):
    """Two GRPO steps on 2 ranks (EP2) with multi-turn tool rollouts: the trajectories carry the engine's routing,
    the trainer replays it, and the trained tokens' logprobs equal the engine's."""
    from routing_replay_worker import loop_steps
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("qwen3_moe", tmp_path / "hf", seed=0, overrides={"max_position_embeddings": 1024})
    extra = {"parallel.tp": 1, "parallel.ep": 2, "algo.routing_replay": "rollout",
             "multi_turn.rollout_fn": "mtrain.rollout.agents.multi_turn:rollout_group", "multi_turn.tools": "calculator",
             "multi_turn.max_turns": 2, "multi_turn.max_total_tokens": 700, "rollout.prompts_per_step": 2,
             "rollout.samples_per_prompt": 2, "train.micro_batch_size": 2, "rollout.max_prompt_len": 600,
             "train.steps": 2}
    records = run_on_ranks(loop_steps, 2, str(hf), str(tmp_path / "run"), extra, timeout=600)
    for rec in records[0]:
        assert 0.0 <= rec["routing/disagreement"] < 0.01, rec
        assert rec["logprob_diff/max_abs"] <= LP_TOL, rec
        assert any(k.startswith("tools/") for k in rec), rec
        # every turn asked only for the rows its trajectory lacked: one int32 payload row per token, no more
        assert rec["routing/engine_bytes_per_token"] == 4 * 2 * 4, rec
