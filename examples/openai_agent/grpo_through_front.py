"""GRPO through the OpenAI front on CPU: agents written only against the `openai` client generate, the front
records their exact tokens, the trainer trains on the recorded trajectories, new weights land in the engine.

    python examples/openai_agent/grpo_through_front.py --steps 12 --out runs/grpo_front.json

The model is a tiny random Llama over a real HF fast tokenizer (characters + ChatML specials, tests/serve); the
agent holds a two-turn conversation ("Pick a character." ... "Once more.") and is rewarded when its second answer
(4 tokens) holds a digit: the random model does that about 0.4 of the time, so a rising reward is learning through
the whole path (HTTP, sessions, token-in-token-out, to_batch with the tool turn's environment tokens masked,
per-token versions). The policy is the HF model itself (as examples/smollm2_tools/train_tool_use.py): this script
tests the data path of server-based RL, not the Megatron trainer. Seeded: every agent run sends its own seed, so
a run samples the same tokens each time.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from pathlib import Path

import torch
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "serve"))

MODEL = "tiny-agent"


def make_agent(seed: int):
    """The agent; each run takes the next number of a counter as its sampling seed (runs start in a fixed order:
    asyncio.gather starts them one by one), so a whole training run samples the same tokens every time."""
    runs = itertools.count(seed)

    async def agent(base_url: str, api_key: str, sample: dict) -> float:
        return await two_turns(base_url, api_key, sample, 1000 * next(runs))
    return agent


async def two_turns(base_url: str, api_key: str, sample: dict, seed: int) -> float:
    c = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    m = [{"role": "user", "content": sample["q"]}]
    try:
        for turn, follow_up in enumerate(("Once more.", None)):
            r = await c.chat.completions.create(model=MODEL, messages=m, max_tokens=4, temperature=1.0,
                                                seed=seed + turn)
            m.append(r.choices[0].message.model_dump(exclude_none=True))
            if follow_up:
                m.append({"role": "user", "content": follow_up})
    finally:
        await c.close()
    return 1.0 if any(ch.isdigit() for ch in (m[-1].get("content") or "")) else 0.0


def token_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


def run(steps: int = 12, groups: int = 4, n: int = 8, lr: float = 1e-2, seed: int = 0) -> dict:
    from front_fixtures import chatml_tokenizer, tiny_config
    from mtrain.algorithms.objective import compute_advantages, policy_loss
    from mtrain.config import load_config
    from mtrain.rollout import ReferenceEngine
    from mtrain.serve.openai_agent import agent_group_fn
    from mtrain.rollout.client import LocalClient
    from mtrain.rollout.reference_engine import as_hf_config, hf_disk_views
    from mtrain.rollout.trajectory import to_batch
    from mtrain.serve.front import OpenAIFront
    from mtrain.serve.server import FrontServer

    torch.manual_seed(seed)
    cfg = load_config(None, ["model.hf_path=unused", "data.task=arithmetic", "algo.name=grpo", "algo.kl_coef=0"])
    tok = chatml_tokenizer()
    hf_cfg = tiny_config(len(tok))
    policy = AutoModelForCausalLM.from_config(as_hf_config(hf_cfg), dtype=torch.float32, attn_implementation="eager")
    policy.train()
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    engine = ReferenceEngine(hf_cfg)

    def push(version: int) -> None:
        specs = engine.parameter_specs()
        engine.update_weights([[(k, v.detach().clone()) for k, v in hf_disk_views(policy).items() if k in specs]])
        engine.finish_weight_update(version)

    push(0)
    client = LocalClient(engine)
    history = []
    agent = make_agent(seed)
    with FrontServer(OpenAIFront(client, tok, model_name=MODEL, max_positions=512)) as server:
        for step in range(1, steps + 1):
            t0 = time.time()
            samples = [{"q": f"Pick a character ({step}.{g})."} for g in range(groups)]
            fn = agent_group_fn(lambda _: server, agent, samples, n)

            async def rollout():
                return await asyncio.gather(*(fn(g, client) for g in range(groups)))
            trajs = [t for group in asyncio.run(rollout()) for t in group]
            versions = {v for t in trajs for s in t.segments if s.kind == "model" for v in s.versions}
            assert versions == {step - 1}, versions  # every recorded token was sampled by the last pushed weights
            batch = to_batch(trajs, pad_id=tok.pad_token_id)
            adv, _ = compute_advantages(cfg.algo, batch.rewards, n, batch.response_mask)
            opt.zero_grad()
            lp = token_logprobs(policy, batch.tokens)
            m = batch.response_mask.bool()
            diff = float((lp.detach() - batch.engine_logprobs).abs()[m].max())
            loss, _ = policy_loss(cfg.algo, lp, lp.detach(), adv, batch.response_mask, norm_len=8,
                                  num_tokens=float(batch.response_mask.sum()), num_seqs=float(batch.size))
            loss.backward()
            opt.step()
            push(step)
            row = {"step": step, "reward": float(batch.rewards.mean()), "trajectories": len(trajs),
                   "model_tokens": int(m.sum()), "logprob_diff_max": diff, "seconds": time.time() - t0,
                   "rerendered": sum(t.metrics["session/rerendered"] for t in trajs)}
            history.append(row)
            print(json.dumps(row), flush=True)
    engine.shutdown()
    k = max(1, steps // 4)
    first = sum(r["reward"] for r in history[:k]) / k
    last = sum(r["reward"] for r in history[-k:]) / k
    return {"steps": steps, "groups": groups, "n": n, "lr": lr, "reward_first": first, "reward_last": last,
            "history": history}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None, help="also draw the reward per step here")
    a = ap.parse_args()
    res = run(a.steps, a.groups, a.n, a.lr)
    print(f"reward: first quarter {res['reward_first']:.3f} -> last quarter {res['reward_last']:.3f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2))
    if a.png:
        draw(res, Path(a.png))


def draw(res: dict, path: Path) -> None:
    """The reward per step, with the first and last quarters' means (what the test asks to rise)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in res["history"]]
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    ax.plot(steps, [r["reward"] for r in res["history"]], marker="o")
    ax.set_title(f"GRPO through the OpenAI front: reward {res['reward_first']:.2f} -> {res['reward_last']:.2f} "
                 f"(first / last quarter)", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (second answer holds a digit)", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
