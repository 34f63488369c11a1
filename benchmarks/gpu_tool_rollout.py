"""Multi-turn tool rollouts on SGLang (one GPU): plumbing, token-in-token-out on the real engine, step times.

    source benchmarks/gpu_setup.sh && python benchmarks/gpu_tool_rollout.py          # writes $OUT/tool_rollout.json
    python benchmarks/gpu_tool_rollout.py --engine reference                         # the same on the CPU engine

A tiny Llama (head_dim 64, as SGLang's fused rope needs) is first taught scripted turns (the character tokenizer;
tests/rollout/scripted_model.py): a turn with two calculator calls, then, after the tool messages, the answer.
Its HF checkpoint starts an SGLangEngine; `rollout_group` runs G groups x n trajectories concurrently through
`LocalClient(engine)` (needs `RolloutEngine.submit`, the engine-pool branch). Checked per trajectory: the model
tokens are SGLang's output ids bit for bit (a recording client keeps every completion), every request's prompt is
the trajectory so far, the turns and tool results are the scripted ones, reward 1, sessions all released; SGLang's
logprobs on the trained tokens against HF's log_softmax on the same sequence (max abs diff, bf16). Timed: the
group rollout wall time with its tool share, tokens per second, and the same rollout single-turn (the tool turn
only, no tools) as the baseline measured in the same run. Also runs the SGLang tool-call parser corpus live.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "rollout"))

CONFIG = dict(model_type="llama", vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
              initializer_range=0.05, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["sglang", "reference"], default="sglang")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tool_rollout.json"))
    a = ap.parse_args()

    from mtrain.data import CharTokenizer, PromptSample
    from mtrain.data.rewards import exact_match_reward
    from mtrain.rollout import SamplingParams
    from mtrain.rollout.agents.multi_turn import RolloutContext, group_metrics, rollout_group
    from mtrain.rollout.client import RecordingClient
    from mtrain.tools.calculator import CalculatorTool
    from mtrain.tools.parsers import ToolCallParser
    from mtrain.tools.server import ToolServer
    from scripted_model import script_tokens, train_scripted_model

    tok = CharTokenizer(128)
    question, turn1 = "What is 123*456?", CALL.format("123*456") + "\n" + CALL.format("9*9")
    replies = [{"role": "tool", "name": "calculator", "content": "56088"},
               {"role": "tool", "name": "calculator", "content": "81"}]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = time.perf_counter()
    model = train_scripted_model([script_tokens(tok, question, [turn1, "56088"], [replies])], steps=600,
                                 config=CONFIG, device=device, lr=3e-3)
    report: dict = {"engine": a.engine, "groups": a.groups, "n": a.n, "train_scripted_s": time.perf_counter() - t}
    hf_dir = tempfile.mkdtemp(prefix="mtrain-tool-rollout-")
    model.to(torch.bfloat16).save_pretrained(hf_dir)
    if a.engine == "sglang":
        from mtrain.rollout.sglang_engine import SGLangEngine
        engine = SGLangEngine(hf_dir, tp_size=1, mem_fraction_static=0.3, random_seed=0,
                              server_args={"dtype": "bfloat16"})
    else:
        from mtrain.rollout import ReferenceEngine
        engine = ReferenceEngine.from_pretrained(hf_dir, dtype=torch.bfloat16)

    tools = ToolServer([CalculatorTool()])
    sample = PromptSample(0, question, "56088")

    def ctx(i, greedy=True, tool_turns=True):
        return RolloutContext(tokenizer=tok, tools=tools, parser=ToolCallParser("qwen25", tools.schemas),
                              params=SamplingParams(max_new_tokens=200, temperature=0.0 if greedy else 1.0,
                                                    stop_token_ids=(tok.eos_token_id,)),
                              reward_fn=exact_match_reward, base_seed=i * 10**5, rid_prefix=f"g{i}",
                              max_turns=4 if tool_turns else 1, max_total_tokens=1024, system_prompt=None)

    async def run(tool_turns: bool):
        client = RecordingClient(engine)
        t0 = time.perf_counter()
        groups = await asyncio.gather(*(rollout_group(sample, a.n, client, ctx(i, tool_turns=tool_turns))
                                        for i in range(a.groups)))
        return [t for g in groups for t in g], client.log, time.perf_counter() - t0

    try:
        asyncio.run(run(True))  # warm-up (CUDA graphs, radix cache of the prompt)
        trajs, log, wall = asyncio.run(run(True))
        base, base_log, base_wall = asyncio.run(run(False))
        by_rid = {}
        for req, comp in log:
            by_rid.setdefault(req.rid.split("t")[0], []).append((req, comp))
        bad = []
        for tr in trajs:
            mine = sorted(by_rid.get(tr.rid, []), key=lambda rc: rc[0].rid)
            ok = (len(mine) == 2 and tr.model_ids == [i for _, c in mine for i in c.output_ids]
                  and [s.kind for s in tr.segments] == ["prompt", "model", "env", "model"]
                  and tr.reward == 1.0 and mine[1][0].prompt_ids == tr.tokens[:len(mine[1][0].prompt_ids)])
            if not ok:
                bad.append({"rid": tr.rid, "kinds": [s.kind for s in tr.segments], "text": tok.decode(tr.tokens)})
        hf = model.to(device=device, dtype=torch.bfloat16)
        diffs = []
        with torch.no_grad():
            for tr in trajs[: min(len(trajs), 16)]:
                ids = torch.tensor([tr.tokens], device=device)
                lp = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
                mask = torch.tensor(tr.loss_mask[1:], device=device).bool()
                ours = torch.tensor([x for s in tr.segments if s.trained for x in s.logprobs], device=device)
                diffs.append((lp[mask] - ours).abs().max().item())
        model_tokens = sum(t.num_model_tokens for t in trajs)
        report.update({
            "trajectories": len(trajs), "tito_mismatches": len(bad), "mismatch_examples": bad[:3],
            "open_sessions_after": tools.open_sessions, "metrics": group_metrics(trajs),
            "rollout_wall_s": wall, "model_tokens": model_tokens, "model_tokens_per_s": model_tokens / wall,
            "requests": len(log), "single_turn_baseline_wall_s": base_wall,
            "single_turn_model_tokens": sum(t.num_model_tokens for t in base),
            "wall_ratio_multi_vs_single": wall / base_wall,
            "logprob_max_abs_diff_vs_hf_bf16": max(diffs) if diffs else None,
        })
    finally:
        engine.shutdown()
    parser_test = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  str(ROOT / "tests/rollout/test_tool_parsers.py")], capture_output=True, text=True,
                                 cwd=ROOT)
    report["parser_corpus_pytest"] = parser_test.stdout.strip().splitlines()[-1:] if parser_test.stdout else \
        parser_test.stderr[-500:]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
