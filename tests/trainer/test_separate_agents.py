"""serve.agent under engine.placement=separate: 4 gloo ranks, 2 training ranks (Megatron TP2 over them only) and 2
engine ranks, each hosting a reference engine and, on first use, the OpenAI front its agents call (real `openai`
client, two turns each). The agents run where the engines live; their sessions' trajectories (token-in/token-out,
engine logprobs, per-token weight versions) reach every rank through the pool, the training ranks included.

Checked per step: every rank holds the same trajectories, bit for bit; each agent run is recorded once (4 distinct
sessions for 2 prompts x 2 samples, none repeated or lost); every model token carries the version of the weights
published before the step; and the training ranks' recomputed logprobs of those tokens equal the engines' (float32),
which holds only if the engine ranks generated with exactly the weights the training ranks sent them.
"""
from __future__ import annotations

from pathlib import Path

from loop_harness import CONFIG, base_overrides
from mtrain.dist import run_on_ranks

AGENTS = Path(__file__).resolve().parent / "agents_for_tests.py"


def _trajectory_record(t) -> tuple:
    return (t.rid, float(t.reward), tuple(t.tokens),
            tuple((s.kind, tuple(s.ids), tuple(s.versions or ()), tuple(s.logprobs or ())) for s in t.segments))


def _separate_agent_steps(rank, world, hf, run_dir):
    from mtrain.config import load_config
    from mtrain.trainer.loop import Trainer
    over = {"engine.placement": "separate", "engine.ranks": 2, "parallel.tp": 2, "serve.agent": f"{AGENTS}:two_turn_digits",
            "train.steps": 2, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
            "train.micro_batch_size": 2, "train.save_interval": -1}
    t = Trainer(load_config(CONFIG, base_overrides(hf, run_dir, **over)))
    seen = []  # what this rank's generation role returned, per step: the pool's groups as this rank received them
    generate = t.generate

    def recording(*args, **kwargs):
        res = generate(*args, **kwargs)
        seen.append([_trajectory_record(tr) for tr in res.trajectories])
        return res
    t.generate = recording
    records = [t.train_step() for _ in range(2)]
    t.generate = generate  # the role itself closes its fronts
    fronts = len(generate.fronts._servers)
    out = {"trains": t.placement.trains, "engine": t.engine is not None, "fronts": fronts, "seen": seen,
           "records": records}
    t.close()
    return out


def test_agents_through_fronts_on_engine_ranks(tmp_path):
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "hf", seed=0)
    res = run_on_ranks(_separate_agent_steps, 4, hf, tmp_path / "run", timeout=600)
    assert [r["trains"] for r in res] == [True, True, False, False]
    assert [r["engine"] for r in res] == [False, False, True, True]
    # fronts only where engines are; the training ranks started none
    assert [r["fronts"] for r in res][:2] == [0, 0] and sum(r["fronts"] for r in res[2:]) >= 1
    for step, trajectories in enumerate(res[0]["seen"]):
        assert all(r["seen"][step] == trajectories for r in res), f"step {step}: ranks disagree on the trajectories"
        assert len(trajectories) == 4 and len({tr[0] for tr in trajectories}) == 4, [tr[0] for tr in trajectories]
        for rid, _, tokens, segments in trajectories:
            model = [s for s in segments if s[0] == "model"]
            assert len(model) == 2, (rid, [s[0] for s in segments])  # the agent's two calls, one branch
            assert {v for s in model for v in s[2]} == {step}, (rid, step)  # weights published before the step
            assert sum(len(s[1]) for s in segments) == len(tokens)
    for rec in res[0]["records"]:
        assert rec["logprob_diff/max_abs"] <= 2e-5, rec["logprob_diff/max_abs"]
        assert rec["session/calls"] == 2.0 and rec["rollout/engines"] >= 1 and rec["sync/bytes"] > 0
