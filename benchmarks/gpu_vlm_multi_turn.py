"""GPU check of multi-turn tool rollouts with an image on SGLang: every turn's request carries the prompt's images.

    source benchmarks/gpu_setup.sh && python benchmarks/gpu_vlm_multi_turn.py      # writes $OUT/vlm_multi_turn.json
    python benchmarks/gpu_vlm_multi_turn.py --engine reference                     # the same on the CPU engine

Needs what benchmarks/gpu_vlm_rollout.py needs (torchvision, Pillow, einops for SGLang's Qwen2.5-VL; it checks).
A tiny Qwen2.5-VL (mtrain.tiny_vlm, GPU head sizes) is taught a scripted calculator conversation about an image
(tests/rollout/scripted_vlm.py: the image in the first user message, a calculator call, the answer after the tool's
reply); its folder starts an SGLangEngine; `rollout_group` runs G groups x n trajectories through a recording
`LocalClient`. Checked per trajectory: two model turns with the scripted tool call and reward 1, every request's
prompt is the trajectory so far and carries the same VisionInputs (SGLang: one "processor_output" item per request),
the model tokens are SGLang's output ids. Against transformers: SGLang's logprobs of every model token vs one
forward of the whole final sequence with the image (bf16 and float32 references) -- a second turn that lost the
image would show a large gap; and the second turn's first top-8 logprobs with another picture of the same grid differ
(the pixels reach turn 2). Timed: the rollout wall time and model tokens per second.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "rollout"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["sglang", "reference"], default="sglang")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "vlm_multi_turn.json"))
    a = ap.parse_args()

    from mtrain.data.datasets import PromptSample
    from mtrain.data.vision import load_vision_processor
    from mtrain.rollout import SamplingParams
    from mtrain.rollout.agents.multi_turn import RolloutContext, group_metrics, rollout_group
    from mtrain.rollout.client import RecordingClient
    from mtrain.rollout.protocol import Request
    from mtrain.tiny_vlm import TINY_VLM_GPU_OVERRIDES, tiny_vlm_config, write_tiny_vlm
    from mtrain.tools.calculator import CalculatorTool
    from mtrain.tools.parsers import ToolCallParser
    from mtrain.tools.server import ToolServer
    from scripted_vlm import ANSWER, QUESTION, REPLIES, REPLY, TURN1, picture, script, train_scripted_vlm

    if a.engine == "sglang":
        from gpu_vlm_rollout import missing_modules
        if missing_modules():
            print(f"gpu_vlm_multi_turn: missing {missing_modules()} (see benchmarks/gpu_vlm_rollout.py)", file=sys.stderr)
            return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    overrides = TINY_VLM_GPU_OVERRIDES if a.engine == "sglang" else None
    work = tempfile.mkdtemp(prefix="mtrain-vlm-mt-")
    model_dir = write_tiny_vlm(os.path.join(work, "tiny-vlm"), seed=0, overrides=overrides)
    proc = load_vision_processor(model_dir, tiny_vlm_config(**(overrides or {})), None)
    tools = ToolServer([CalculatorTool()])
    ids, mask, vision = script(proc, QUESTION, [picture()], [TURN1, ANSWER], [REPLIES], tools.schemas)
    t0 = time.perf_counter()
    train_scripted_vlm(model_dir, ids, mask, vision, steps=600, lr=3e-3, device=device)
    report: dict = {"engine": a.engine, "groups": a.groups, "n": a.n, "train_scripted_s": time.perf_counter() - t0,
                    "prompt_tokens": vision.tokens_per_image}
    if a.engine == "sglang":
        from mtrain.rollout.sglang_engine import SGLangEngine
        engine = SGLangEngine(str(model_dir), tp_size=1, mem_fraction_static=0.3, random_seed=0,
                              server_args={"dtype": "bfloat16"})
    else:
        from mtrain.rollout.reference_engine import ReferenceEngine
        engine = ReferenceEngine.from_pretrained(str(model_dir))

    sample = PromptSample(0, QUESTION, REPLY, images=(picture(),))

    def ctx(i):
        return RolloutContext(tokenizer=proc, tools=tools, parser=ToolCallParser("qwen25", tools.schemas),
                              params=SamplingParams(max_new_tokens=160, temperature=1.0,
                                                    stop_token_ids=(proc.eos_token_id,)),
                              reward_fn=lambda response, answer, **_: float(str(answer) in response),
                              base_seed=i * 10**5, rid_prefix=f"g{i}", max_turns=3, max_total_tokens=1024,
                              system_prompt=None)

    async def run():
        client = RecordingClient(engine)
        t = time.perf_counter()
        groups = await asyncio.gather(*(rollout_group(sample, a.n, client, ctx(i)) for i in range(a.groups)))
        return [x for g in groups for x in g], client.log, time.perf_counter() - t

    try:
        asyncio.run(run())  # warm-up
        trajs, log, wall = asyncio.run(run())
        by_rid: dict = {}
        for req, comp in log:
            by_rid.setdefault(req.rid.split("t")[0], []).append((req, comp))
        bad = []
        for tr in trajs:
            mine = sorted(by_rid.get(tr.rid, []), key=lambda rc: rc[0].rid)
            ok = (tr.model_ids == [i for _, c in mine for i in c.output_ids]
                  and all(r.vision is tr.vision and r.prompt_ids == tr.tokens[:len(r.prompt_ids)] for r, _ in mine))
            if not ok:
                bad.append(tr.rid)
        two_turn = [t for t in trajs if [s.kind for s in t.segments] == ["prompt", "model", "env", "model"]]
        from transformers import AutoModelForImageTextToText
        gaps = {}
        for dtype in (torch.bfloat16, torch.float32):
            hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
            d = []
            with torch.no_grad():
                for tr in two_turn[:16]:
                    full = torch.tensor([tr.tokens], device=device)
                    v = tr.vision
                    logits = hf(input_ids=full, pixel_values=v.pixel_values.to(device),
                                image_grid_thw=v.image_grid_thw.to(device),
                                mm_token_type_ids=v.mm_token_type_ids(full.cpu()).to(device)).logits[0, :-1].float()
                    lp = torch.log_softmax(logits, -1).gather(-1, full[0, 1:, None])[:, 0]
                    m = torch.tensor(tr.loss_mask[1:], device=device).bool()
                    ours = torch.tensor([x for s in tr.segments if s.trained for x in s.logprobs], device=device)
                    d.append((lp[m] - ours).abs())
            cat = torch.cat(d) if d else torch.zeros(0)
            gaps[str(dtype)[6:]] = {"mean_abs": cat.mean().item() if cat.numel() else None,
                                    "max_abs": cat.max().item() if cat.numel() else None, "tokens": cat.numel()}
            del hf
        swap = None
        if two_turn:  # turn 2's request with another picture of the same grid: its first logprob must change
            tr = two_turn[0]
            turn2 = tr.tokens[:len(tr.tokens) - len(tr.segments[3].ids)]
            other = proc.vision_inputs([picture(seed=9)], "swap")
            greedy = SamplingParams(max_new_tokens=1, temperature=0.0, top_logprobs=8)  # the tail moves most
            own, alt = engine.generate([Request("own-", turn2, greedy, vision=tr.vision),
                                        Request("swap-", turn2, greedy, vision=other)])
            a_lp, b_lp = dict(own.top_logprobs[0]), dict(alt.top_logprobs[0])
            swap = max(abs(a_lp[k] - b_lp[k]) for k in a_lp.keys() & b_lp.keys())
        model_tokens = sum(t.num_model_tokens for t in trajs)
        report.update({
            "trajectories": len(trajs), "two_turn_share": len(two_turn) / max(len(trajs), 1),
            "tito_or_image_mismatches": len(bad), "examples": bad[:3], "metrics": group_metrics(trajs),
            "logprob_gap_vs_hf": gaps, "turn2_other_pixels_first_logprob_diff": swap,
            "rollout_wall_s": wall, "model_tokens": model_tokens, "model_tokens_per_s": model_tokens / wall,
            "requests": len(log), "open_sessions_after": tools.open_sessions})
        report["ok"] = bool(not bad and two_turn and (swap or 0) > 1e-2 and gaps["bfloat16"]["mean_abs"] < 0.05)
    finally:
        engine.shutdown()
        print(json.dumps(report, indent=1, default=str))
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":  # SGLang spawns its schedulers: the module must be importable without side effects
    sys.exit(main())
