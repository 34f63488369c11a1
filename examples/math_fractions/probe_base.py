"""Greedy accuracy of a model on each task family of make_data.py, scored by math_verify_reward: what picks the
example's task (a family the model solves a few times in ten: groups of samples then score mixed, which is GRPO's
signal; near 0 or near 1 gives none).
    python examples/math_fractions/probe_base.py [--hf HF_DIR] [--n 48] [--tasks a,b] [--max-new-tokens 48]
Prints one line per task family: accuracy, the share of responses with a \\boxed{} answer, one example response.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_data import TASKS, messages  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", default=None)
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--shots", type=int, default=3, help="solved examples in each prompt (make_data.py --shots)")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mtrain.data.boxed import last_boxed
    from mtrain.data.rewards import math_verify_reward

    hf = args.hf
    if hf is None:
        from mtrain.converters.smollm2 import smollm2_hf_dir
        hf = str(smollm2_hf_dir())
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(hf)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    for name in args.tasks.split(","):
        rng = random.Random(0)
        probs = [TASKS[name](rng) for _ in range(args.n)]
        msgs = [messages(text, name, args.shots) for text, _ in probs]
        texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in msgs]
        outs = []
        for i in range(0, len(texts), 16):
            enc = tok(texts[i:i + 16], return_tensors="pt", padding=True)
            with torch.no_grad():
                gen = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                                     pad_token_id=tok.pad_token_id or tok.eos_token_id)
            outs += tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        scores = [math_verify_reward(o, gold) for o, (_, gold) in zip(outs, probs)]
        boxed = sum(last_boxed(o) is not None for o in outs) / len(outs)
        print(f"{name}: accuracy {sum(scores) / len(scores):.3f} boxed {boxed:.2f} n {len(outs)} | "
              f"{probs[0][0]!r} -> {outs[0][:90]!r} (gold {probs[0][1]})", flush=True)


if __name__ == "__main__":
    main()
