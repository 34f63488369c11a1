"""SmolLM2-135M-Instruct learns to use a calculator tool with GRPO, on CPU: multi-turn tool rollouts for real.

Task: "What is 347 * 829?" (two 3-digit numbers: the model cannot do it in its head). Tool: the calculator, called
in the qwen25 format. The prompt holds one worked example (a different product, the call, the tool's answer,
the final answer); reward 1 when the final turn's number is the product (exact_match_reward).

What is ours here and what is not: the rollouts are `rollout_group` on the CPU reference engine (token-in-token-
out, tool sessions, parsing, drift), the batch is `to_batch`, advantages and loss are `mtrain.algorithms`
(GRPO preset), weights go to the engine through `update_weights` every step. The policy being trained is the HF
model in this process (plain torch autograd), NOT the Megatron trainer; the same task through `mtrain train`
(Megatron-core, multi_turn.rollout_fn) is examples/smollm2_tools/run.sh with config.yaml. Metrics also report engine-vs-trainer logprob agreement on the trained tokens: a check that the tokens the
trainer scores are exactly those the engine sampled.

    python examples/smollm2_tools/train_tool_use.py --steps 10 --out docs/smollm2_tools_demo.json \
        --png docs/smollm2_tools_demo.png
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mtrain.algorithms.objective import compute_advantages, policy_loss
from mtrain.config import load_config
from mtrain.converters.smollm2 import smollm2_hf_dir
from mtrain.data.rewards import exact_match_reward
from mtrain.metrics import MetricsWriter
from mtrain.plot import plot_run
from mtrain.rollout import ReferenceEngine, SamplingParams
from mtrain.rollout.agents.multi_turn import group_metrics, rollout_group
from mtrain.rollout.agents.setup import build_tool_server, make_context
from mtrain.rollout.client import LocalClient
from mtrain.rollout.reference_engine import hf_disk_views
from mtrain.rollout.trajectory import to_batch

from calculator_task import SYSTEM, splits  # this folder (sys.path[0])


async def run_groups(samples, n, engine, cfg, tok, tools, params, *, seed, prefix, greedy=False):
    client = LocalClient(engine)
    groups = [rollout_group(s, n, client, make_context(cfg, tok, tools, exact_match_reward, base_seed=seed + i * 10**5,
                                                       rid_prefix=f"{prefix}-p{i}", params=params, greedy=greedy,
                                                       max_positions=engine.hf_config.max_position_embeddings))
              for i, s in enumerate(samples)]
    return [t for g in await asyncio.gather(*groups) for t in g]


def evaluate(samples, engine, cfg, tok, tools, params, step):
    trajs = asyncio.run(run_groups(samples, 1, engine, cfg, tok, tools, params, seed=7, prefix=f"eval{step}",
                                   greedy=True))
    m = group_metrics(trajs)
    return {"eval/accuracy": sum(t.reward for t in trajs) / len(trajs), "eval/tool_call_rate": m["tools/call_rate"],
            "eval/valid_call_rate": m["tools/valid_rate"], "eval/drift_tokens": m["traj/drift/tokens"]}


def token_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (GRPO group)")
    ap.add_argument("--eval", type=int, default=32, help="held-out prompts, greedy")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=40, help="per turn")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--run-dir", default="runs/smollm2_tools")
    ap.add_argument("--out", default=None, help="summary JSON")
    ap.add_argument("--zero-shot", action="store_true", help="no worked example in the prompt")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the base model and stop")
    ap.add_argument("--png", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    start = time.time()
    hf = smollm2_hf_dir()
    cfg = load_config(None, [f"model.hf_path={hf}", "data.task=arithmetic", "algo.name=grpo", "algo.kl_coef=0",
                             "multi_turn.tools=calculator", "multi_turn.max_turns=3",
                             "multi_turn.max_total_tokens=448", "multi_turn.parser_backend=mtrain"])
    cfg.multi_turn.system_prompt = SYSTEM  # (an a.b=value override would keep the quotes of a long string)
    tok = AutoTokenizer.from_pretrained(hf)
    policy = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=a.lr, weight_decay=0.0)
    engine = ReferenceEngine.from_pretrained(hf)
    tools = build_tool_server(cfg.multi_turn)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, stop_token_ids=(eos,))
    train_set, eval_set = splits(a.steps * a.prompts, a.eval, shot=not a.zero_shot)
    run_dir = Path(a.run_dir)
    writer = MetricsWriter(run_dir, resume_step=None, total_steps=a.steps, tensorboard=False)
    first_eval = evaluate(eval_set, engine, cfg, tok, tools, params, 0)
    writer.log(0, first_eval)
    print("step 0", first_eval, flush=True)
    evals = {0: first_eval}
    for step in range(1, 0 if a.eval_only else a.steps + 1):
        t0 = time.time()
        samples = train_set[(step - 1) * a.prompts: step * a.prompts]
        trajs = asyncio.run(run_groups(samples, a.samples, engine, cfg, tok, tools, params, seed=step * 10**7,
                                       prefix=f"s{step}"))
        t1 = time.time()
        batch = to_batch(trajs, pad_id=tok.pad_token_id or 0)
        adv, adv_m = compute_advantages(cfg.algo, batch.rewards, a.samples, batch.response_mask)
        opt.zero_grad()
        n_tok = float(batch.response_mask.sum())
        diffs, loss_sum = [], 0.0
        for s in range(0, batch.size, a.micro_batch):
            mb = batch.select(slice(s, s + a.micro_batch))
            lp = token_logprobs(policy, mb.tokens)
            m = mb.response_mask.bool()
            diffs.append((lp.detach() - mb.engine_logprobs).abs()[m])
            # one update per rollout: old = the policy's own logprobs (ratio 1), token-level sum over the batch
            loss, _ = policy_loss(cfg.algo, lp, lp.detach(), adv[s:s + a.micro_batch], mb.response_mask,
                                  norm_len=a.max_new_tokens, num_tokens=n_tok, num_seqs=float(batch.size))
            loss.backward()
            loss_sum += float(loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0))
        opt.step()
        views = hf_disk_views(policy)
        specs = engine.parameter_specs()
        engine.update_weights([[(k, v.detach().clone()) for k, v in views.items() if k in specs]])
        engine.finish_weight_update(step)
        t2 = time.time()
        d = torch.cat(diffs)
        metrics = {"reward/mean": float(batch.rewards.mean()), **{k: float(v) for k, v in group_metrics(trajs).items()},
                   "group/uniform_frac": float(adv_m.get("group/uniform_frac", 0.0)), "loss": loss_sum,
                   "grad_norm": grad_norm, "logprob_diff/mean_abs": float(d.mean()),
                   "logprob_diff/max_abs": float(d.max()), "trained_tokens": n_tok,
                   "time/rollout": t1 - t0, "time/train": t2 - t1}
        if step == a.steps or step % max(a.steps // 2, 1) == 0:
            metrics.update(evaluate(eval_set, engine, cfg, tok, tools, params, step))
            evals[step] = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        writer.log(step, metrics)
        print(f"step {step}", json.dumps({k: round(v, 4) for k, v in metrics.items()}), flush=True)
    wall = time.time() - start
    engine.shutdown()
    if a.png:
        plot_run(run_dir, a.png, keys=("reward/mean", "tools/call_rate", "tools/valid_rate", "eval/accuracy",
                                       "logprob_diff/max_abs"))
    if a.out:
        summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.platform(),
                   "command": " ".join([Path(sys.executable).name] + sys.argv), "wall_s": round(wall, 1),
                   "args": vars(a), "evals": evals, "metrics_file": str(run_dir / "metrics.jsonl")}
        Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"done in {wall:.0f} s", flush=True)


if __name__ == "__main__":
    main()
