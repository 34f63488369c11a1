"""The Trainer with the engine pool: 4 real gloo ranks, one reference engine per engine group.

For each (training layout, engine.tp): after the first sync every engine holds exactly the HF checkpoint's weights
(read from disk by safetensors: independent of the planner); after a trained step every engine holds the same bits
as every other, and each engine's sampling logprobs equal the trainer's recomputation within float32 rounding (a
different code path: HF transformers' forward vs Megatron's). The metrics say how the groups spread over the
engines. engine.offload_train moves the bytes it reports and changes no result.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loop_harness import CONFIG, TEST_REWARDS, TIME_KEYS, base_overrides, without_time
from mtrain.dist import run_on_ranks

AGENTS = Path(__file__).resolve().parent / "agents_for_tests.py"

CASES = {  # name -> (arch, overrides)
    "tp2pp2": ("llama", {"parallel.tp": 2, "parallel.pp": 2}),
    "tp2": ("llama", {"parallel.tp": 2}),
    "pp2": ("llama", {"parallel.tp": 1, "parallel.pp": 2}),
    "ep2_moe": ("qwen3_moe", {"parallel.tp": 1, "parallel.ep": 2}),
    "deepseek_v3": ("deepseek_v3", {"parallel.tp": 1, "parallel.ep": 2}),
}
DEFAULT = {("tp2pp2", 1), ("ep2_moe", 2), ("deepseek_v3", 4)}  # the rest of the grid: MTRAIN_SLOW=1
GRID = [pytest.param(c, tp, marks=() if (c, tp) in DEFAULT else pytest.mark.slow, id=f"{c}-engine_tp{tp}")
        for c in CASES for tp in (1, 2, 4)]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    root = tmp_path_factory.mktemp("hf")
    return {arch: write_tiny_hf(arch, root / arch, seed=0) for arch in ("llama", "qwen3_moe", "deepseek_v3")}


def _engine_weights(engine) -> dict[str, torch.Tensor]:
    from mtrain.rollout.reference_engine import hf_disk_views
    return {k: v.detach().clone() for k, v in hf_disk_views(engine._model).items()}


def _disk(hf) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(Path(hf).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _pool_steps(rank, world, hf, run_dir, overrides):
    from mtrain.config import load_config
    from mtrain.trainer.loop import Trainer
    t = Trainer(load_config(CONFIG, base_overrides(hf, run_dir, **overrides)))
    out = {"records": [], "engines": t.decisions.groups.count}
    if t.engine is not None:
        disk = _disk(hf)
        w = _engine_weights(t.engine)
        out["initial_equal_disk"] = sorted(w) == sorted(k for k in disk if k in w) and \
            all(torch.equal(w[k], disk[k].to(w[k].dtype)) for k in w)
    for _ in range(2):
        out["records"].append(t.train_step())
    if t.engine is not None:
        out["weights"] = _engine_weights(t.engine)
        out["version"] = t.engine.weight_version
    t.close()
    return out


@pytest.mark.parametrize("case,engine_tp", GRID)
def test_every_engine_synced(hf_dirs, tmp_path, case, engine_tp):
    arch, overrides = CASES[case]
    res = run_on_ranks(_pool_steps, 4, hf_dirs[arch], tmp_path / "run",
                       {**overrides, "engine.tp": engine_tp, "rollout.prompts_per_step": 8, "train.steps": 2},
                       timeout=600)
    leaders = [r for r in res if "weights" in r]
    assert len(leaders) == 4 // engine_tp == res[0]["engines"]
    for lead in leaders:
        assert lead["initial_equal_disk"] and lead["version"] == 2
        for k, v in leaders[0]["weights"].items():
            assert torch.equal(lead["weights"][k], v), k
    for rec in res[0]["records"]:
        assert rec["logprob_diff/max_abs"] <= 2e-5, rec["logprob_diff/max_abs"]
        assert rec["rollout/groups_per_engine_min"] + rec["rollout/groups_per_engine_max"] > 0
        assert rec["rollout/engines"] >= 1
    # weights moved: the trained step changed the engines' copies away from the checkpoint
    disk = _disk(hf_dirs[arch])
    w = leaders[0]["weights"]
    assert sum(not torch.equal(w[k], disk[k].to(w[k].dtype)) for k in w) > 0.5 * len(w)


def _offload_steps(rank, world, hf, run_dir, offload):
    from mtrain.config import load_config
    from mtrain.trainer.loop import Trainer
    t = Trainer(load_config(CONFIG, base_overrides(hf, run_dir, **{"engine.offload_train": offload,
                                                                    "train.steps": 2})))
    seen = {}
    rollout = t.generate

    def during_rollout(*a, **k):  # while the engines generate, the offloaded storages hold no bytes
        from mtrain.trainer.learner.offload import _storages
        seen["sizes"] = [s.untyped_storage().nbytes() for s in _storages(t.actor)] if not t.learner.offload.offloaded \
            else [h[0].untyped_storage().nbytes() for h in t.learner.offload._held]
        return rollout(*a, **k)

    t.generate = during_rollout  # the generation function every source calls
    records = [t.train_step() for _ in range(2)]
    t.generate = rollout
    local_params = sum(p.numel() for c in t.actor.chunks for p in c.parameters())
    t.close()
    return records, seen["sizes"], local_params


def test_offload_train_moves_its_bytes_and_changes_nothing(hf_dirs, tmp_path):
    off = run_on_ranks(_offload_steps, 2, hf_dirs["llama"], tmp_path / "off", "false", timeout=300)
    on = run_on_ranks(_offload_steps, 2, hf_dirs["llama"], tmp_path / "on", "true", timeout=300)
    for (rec_off, _, _), (rec_on, sizes, params) in zip(off, on):
        # without times and measured peaks (peak RSS moves with the machine and with offloading itself)
        strip = [{k: v for k, v in without_time(r).items() if not k.startswith(("offload/", "reload/"))} for r in rec_on]
        assert strip == [without_time(r) for r in rec_off]
        assert all(s == 0 for s in sizes)  # really freed during the rollout
        # fp32 model, TP2: gradient buffer (fp32) + Adam's two moments of this rank's parameters, at least
        assert rec_on[1]["offload/bytes"] >= 12 * params and rec_on[1]["reload/bytes"] == rec_on[1]["offload/bytes"]


def _partial_steps(rank, world, hf, run_dir):
    from mtrain.config import load_config
    from mtrain.trainer.loop import Trainer
    from mtrain.trainer import checkpoint
    over = {"algo.name": "dapo", "reward.fn": f"{TEST_REWARDS}:odd_answers_only", "rollout.partial": "true",
            "rollout.over_sample": 2.0, "rollout.max_new_tokens": 24, "train.steps": 2, "train.save_interval": 2,
            "rollout.max_staleness": 3}
    cfg = load_config(CONFIG, base_overrides(hf, run_dir, **over))
    t = Trainer(cfg)
    out = {"records": [], "groups": []}
    rollout = t.source.partial.step

    def seen(*a, **k):  # what every rank trains on: the groups' rewards, in order
        res = rollout(*a, **k)
        n = cfg.rollout.samples_per_prompt
        out["groups"].append([res.rewards[i:i + n] for i in range(0, len(res.rewards), n)])
        out.setdefault("versions", []).append([c.versions for c in res.completions])
        return res

    t.source.partial.step = seen
    t.run()
    out["buffer"] = t.source.partial.state_dict()
    t.close()
    # a restart resumes the buffer from the checkpoint, unfinished samples and all
    t2 = Trainer(load_config(CONFIG, base_overrides(hf, run_dir, **over)))
    out["resumed_buffer"] = t2.source.partial.state_dict()
    out["resumed_step"] = t2.step
    out["latest"] = checkpoint.find_latest(run_dir).name
    t2.close()
    return out


def test_partial_rollout_trains_exactly_the_quota_and_checkpoints_the_buffer(hf_dirs, tmp_path):
    res = run_on_ranks(_partial_steps, 2, hf_dirs["llama"], tmp_path / "run", timeout=400)
    for out in res:
        assert out["resumed_step"] == 2 and out["latest"] == "step_2"
        assert out["resumed_buffer"] == out["buffer"]  # the buffer survives a restart exactly
        for step, groups in enumerate(out["groups"]):
            assert len(groups) == 4  # rollout.prompts_per_step of the config, over-sampled 2x
            assert all(len(set(g)) > 1 for g in groups)  # DAPO: only groups with a learning signal count
            for per_sample in out["versions"][step]:
                assert all(step - 3 <= v <= step for v in per_sample)  # produced by this or a recent version
    assert res[0]["groups"] == res[1]["groups"] and res[0]["buffer"] == res[1]["buffer"]  # every rank agrees


def _multi_turn_steps(rank, world, hf, run_dir):
    from mtrain.config import load_config
    from mtrain.trainer.loop import Trainer
    over = {"multi_turn.rollout_fn": "mtrain.rollout.agents.multi_turn:rollout_group", "multi_turn.tools": "calculator",
            "multi_turn.max_turns": 2, "multi_turn.max_total_tokens": 700, "train.steps": 2,
            "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "train.micro_batch_size": 2,
            "rollout.max_prompt_len": 600}
    t = Trainer(load_config(CONFIG, base_overrides(hf, run_dir, **over)))
    records = [t.train_step() for _ in range(2)]
    t.close()
    return records


def test_multi_turn_tool_rollouts_train_through_the_pool(hf_dirs, tmp_path):
    """The trainer with multi_turn.rollout_fn: two engines serve tool-rollout groups, the batch comes from the
    trajectories (model turns trained, the rest masked), and the trainer's logprobs of the trained tokens equal the
    engine's (a random model rarely calls the tool; tests/rollout/test_multi_turn.py covers the calls themselves)."""
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "hf", seed=0, overrides={"max_position_embeddings": 1024})  # the tool list
    res = run_on_ranks(_multi_turn_steps, 2, hf, tmp_path / "run", timeout=400)  # in the system prompt is long
    for rec in res[0]:
        assert rec["logprob_diff/max_abs"] <= 2e-5
        assert "tools/tool_call_rate" in rec or any(k.startswith("tools/") for k in rec)
        assert rec["rollout/engines"] >= 1
    assert [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in res[1]] == \
        [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in res[0]]


def _partial_multi_turn_steps(rank, world, hf, run_dir):
    from mtrain.config import load_config
    from mtrain.trainer.loop import Trainer
    over = {"multi_turn.rollout_fn": "mtrain.rollout.agents.multi_turn:rollout_group", "multi_turn.max_turns": 2,
            "multi_turn.max_total_tokens": 700, "train.steps": 2, "rollout.prompts_per_step": 2,
            "rollout.samples_per_prompt": 2, "train.micro_batch_size": 2, "rollout.max_prompt_len": 600,
            "rollout.partial": "true", "rollout.max_new_tokens": 48}
    t = Trainer(load_config(CONFIG, base_overrides(hf, run_dir, **over)))
    records = [t.train_step() for _ in range(2)]
    state = t.source.partial.state_dict()
    t.close()
    return records, state


def test_partial_rollout_of_multi_turn_trajectories_trains(tmp_path):
    """rollout.partial with multi_turn.rollout_fn: two engines, 4 tool-rollout groups in flight per step, the quota
    of 2 trained (the batch from trajectories, old-version tokens masked), the rest buffered as trajectories
    (tests/rollout/test_partial_multi_turn.py checks resumption itself)."""
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "hf", seed=0, overrides={"max_position_embeddings": 1024})
    res = run_on_ranks(_partial_multi_turn_steps, 2, hf, tmp_path / "run", timeout=400)
    for records, state in res:
        assert state["kind"] == "multi_turn" and state == res[0][1]  # every rank holds the same buffer
        for rec in records:
            assert rec["rollout/groups_in_flight"] == 4 and "perf/tail_wait_frac" in rec
            # a step whose trained groups hold only resumed tokens of older weights masks them all (offpolicy=mask,
            # which groups make the quota is a race) and reports no gap; every reported gap is held to the bound
            assert rec.get("logprob_diff/max_abs", 0.0) <= 2e-5 and any(k.startswith("tools/") for k in rec)
        assert records[0]["logprob_diff/max_abs"] <= 2e-5  # step 1 has no older tokens: its gap is always there
        assert records[0]["rollout/offpolicy_token_frac"] == 0.0


def _agent_steps(rank, world, hf, run_dir, extra=None):
    from mtrain.config import load_config
    from mtrain.trainer.loop import Trainer
    over = {"serve.agent": f"{AGENTS}:two_turn_digits", "train.steps": 2, "rollout.prompts_per_step": 2,
            "rollout.samples_per_prompt": 2, "train.micro_batch_size": 2, **(extra or {})}
    t = Trainer(load_config(CONFIG, base_overrides(hf, run_dir, **over)))
    records = [t.train_step() for _ in range(2)]
    t.close()
    return records


def test_openai_client_agents_train_through_the_front(hf_dirs, tmp_path):
    """serve.agent: each engine leader serves an OpenAI front, the agents (real `openai` client, two turns each) run
    through the pool, and the trainer's logprobs of the recorded model tokens equal the engines'."""
    res = run_on_ranks(_agent_steps, 2, hf_dirs["llama"], tmp_path / "run", timeout=400)
    for rec in res[0]:
        assert rec["logprob_diff/max_abs"] <= 2e-5
        assert rec["session/calls"] == 2.0 and rec["rollout/engines"] >= 1
    assert [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in res[1]] == \
        [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in res[0]]


def test_agents_sessions_carry_the_engines_routing_for_replay(hf_dirs, tmp_path):
    """serve.agent with algo.routing_replay=rollout on a MoE model (EP2): every recorded session branch keeps the
    engine's routing of its tokens (the first call's rows as first recorded, the second call's for the rest), the
    trainer replays it, and the trained tokens' logprobs equal the engines' (float32)."""
    extra = {"parallel.tp": 1, "parallel.ep": 2, "algo.routing_replay": "rollout"}
    res = run_on_ranks(_agent_steps, 2, hf_dirs["qwen3_moe"], tmp_path / "run", extra, timeout=400)
    for rec in res[0]:
        assert rec["logprob_diff/max_abs"] <= 1e-5, rec
        assert 0.0 <= rec["routing/disagreement"] < 0.01, rec
        assert rec["session/calls"] == 2.0
        # the second call asked only for the rows its branch lacked: one int32 payload row per token (4 layers x top-2)
        assert rec["routing/engine_bytes_per_token"] == 4 * 2 * 4, rec

