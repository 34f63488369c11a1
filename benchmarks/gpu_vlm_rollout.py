"""GPU check of image rollouts: a tiny random Qwen2.5-VL in SGLang, prompts with images, against transformers.

    source benchmarks/gpu_setup.sh && python benchmarks/gpu_vlm_rollout.py     # writes $OUT/vlm_rollout.json
    python benchmarks/gpu_vlm_rollout.py --dry                                 # CPU: model dir, prompts, image items

Needs, besides the SGLang bundle: torchvision (SGLang's Qwen-VL processor module imports it at the top,
multimodal/processors/qwen_vl.py:9-10, and a failed import drops the processor: managers/multimodal_processor.py:
20-24), Pillow and einops (models/qwen2_5_vl.py:34). The bundle and the machine's image hold none of them; the
script checks first and says what is missing.

Steps: write the tiny VLM (mtrain.tiny_vlm, GPU head sizes) with its processor files; render count_shapes prompts
(images of different sizes) once with mtrain's VisionProcessor; start SGLangEngine (skip_tokenizer_init, images as
one "processor_output" item per request: sglang_wire.sglang_image_data); generate GRPO-style groups (n samples,
distinct seeds); compare every token's logprob with transformers' Qwen2_5_VLForConditionalGeneration forward of
prompt + output (bf16 and float32 references); check that the images reach the model (the same prompt ids with
other pixels give other logprobs); time the generation against a text-only batch of the same token count.
"""
from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import json
import os
import sys
import tempfile
import time

import torch

N_PROMPTS, N_SAMPLES, NEW_TOKENS = 16, 4, 32


def missing_modules() -> list[str]:
    return [m for m in ("torchvision", "PIL", "einops") if importlib.util.find_spec(m) is None]


def hf_logprobs(model, prompt: list[int], output: list[int], vision, device: str) -> torch.Tensor:
    full = torch.tensor([prompt + output], device=device)
    kwargs = {}
    if vision is not None:
        kwargs = dict(pixel_values=vision.pixel_values.to(device), image_grid_thw=vision.image_grid_thw.to(device),
                      mm_token_type_ids=vision.mm_token_type_ids(full))
    with torch.no_grad():
        logits = model(input_ids=full, **kwargs).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits, -1)
    return lp.gather(1, torch.tensor(output, device=device)[:, None])[:, 0].cpu()


def gap(model, reqs, comps, device) -> dict:
    d = torch.cat([(hf_logprobs(model, r.prompt_ids, c.output_ids, r.vision, device) - torch.tensor(c.logprobs)).abs()
                   for r, c in zip(reqs, comps) if c.output_ids])
    return {"mean_abs": d.mean().item(), "max_abs": d.max().item(), "tokens": d.numel()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry", action="store_true", help="CPU: model dir, prompts and SGLang image items only")
    ap.add_argument("--deterministic", action="store_true",
                    help="enable_deterministic_inference: per-request seeds make samples batch-independent")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(570, exit=True)

    from mtrain.data.chat import tokenize_prompts
    from mtrain.data.count_shapes import make_count_shapes_splits
    from mtrain.data.vision import load_vision_processor
    from mtrain.rollout.protocol import Request, SamplingParams
    from mtrain.rollout.sglang_wire import sglang_image_data
    from mtrain.tiny_vlm import TINY_VLM_GPU_OVERRIDES, tiny_vlm_config, write_tiny_vlm

    work = tempfile.mkdtemp(prefix="mtrain-vlm-")
    model_dir = write_tiny_vlm(os.path.join(work, "tiny-vlm"), seed=0, overrides=TINY_VLM_GPU_OVERRIDES)
    proc = load_vision_processor(model_dir, tiny_vlm_config(**TINY_VLM_GPU_OVERRIDES), None)
    samples, _ = make_count_shapes_splits(N_PROMPTS, 0, seed=0)
    prompts = tokenize_prompts(samples, proc, max_prompt_len=1024)
    reqs = [Request(f"p{i:02d}-{j}-", p.ids, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0,
                                                               seed=1000 + i * N_SAMPLES + j), vision=p.vision)
            for i, p in enumerate(prompts) for j in range(N_SAMPLES)]
    grids = sorted({tuple(p.vision.image_grid_thw[0].tolist()) for p in prompts})
    summary: dict = {"ok": False, "timings_s": {}, "checks": {"image_grids": grids,
                                                            "prompt_tokens": [len(p.ids) for p in prompts]}}
    if args.dry:
        item = sglang_image_data(reqs[0])[0]
        print(json.dumps({"grids": grids, "item": {k: (list(v.shape) if torch.is_tensor(v) else v)
                                                   for k, v in item.items()}}))
        return 0
    missing = missing_modules()
    if missing:
        print(f"gpu_vlm_rollout: missing {missing}: SGLang's Qwen2.5-VL needs them. Carry wheels for Python 3.12 and "
              f"install them into the bundle's folder, e.g. pip download --no-deps --only-binary=:all: "
              f"--python-version 3.12 --platform manylinux_2_28_x86_64 torchvision==0.26.0 pillow einops "
              f"(torchvision from https://download.pytorch.org/whl/cu130 to match torch 2.11+cu130), then "
              f"pip install --no-deps --no-index --target $MTRAIN_SITE *.whl", file=sys.stderr)
        return 2

    from transformers import AutoModelForImageTextToText

    from mtrain.rollout.sglang_engine import SGLangEngine
    from gpu_summary import reported  # this script's folder is on sys.path

    T, C = summary["timings_s"], summary["checks"]
    with reported(summary, "vlm_rollout.json") as engines:
        t0 = time.perf_counter()
        eng = SGLangEngine(str(model_dir), tp_size=1, mem_fraction_static=0.3, deterministic=args.deterministic,
                           server_args={"dtype": "bfloat16"})
        engines.append(eng)
        T["engine_start"] = time.perf_counter() - t0
        eng.generate(reqs[:2])  # warm-up (kernels, the multimodal processor's workers)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        comps = eng.generate(reqs)
        T["generate_images"] = time.perf_counter() - t0
        # Baseline in the same run: the same prompt lengths as text only (image tokens replaced by a letter).
        text_reqs = [Request(r.rid + "t", [7 if t == proc.image_token_id else t for t in r.prompt_ids], r.params)
                     for r in reqs]
        t0 = time.perf_counter()
        eng.generate(text_reqs)
        T["generate_text_same_lengths"] = time.perf_counter() - t0
        T["ratio_images_over_text"] = T["generate_images"] / T["generate_text_same_lengths"]
        C["finish_length"] = sum(c.finish_reason == "length" for c in comps) / len(comps)
        C["distinct_per_group"] = min(len({tuple(c.output_ids) for c in comps[i:i + N_SAMPLES]})
                                      for i in range(0, len(comps), N_SAMPLES))
        for dtype in (torch.bfloat16, torch.float32):
            hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype).cuda().eval()
            C[f"logprob_gap_vs_hf_{str(dtype)[6:]}"] = gap(hf, reqs, comps, "cuda")
            del hf
        # The pixels reach the model: greedy on prompt 0's ids with its own pixels and with another image's pixels
        # of the same grid -> the first token's logprob differs.
        same = [i for i, p in enumerate(prompts[1:], 1)
                if torch.equal(p.vision.image_grid_thw, prompts[0].vision.image_grid_thw)]
        if same:
            greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
            own, other = eng.generate([Request("own-", prompts[0].ids, greedy, vision=prompts[0].vision),
                                       Request("swap-", prompts[0].ids, greedy, vision=prompts[same[0]].vision)])
            C["other_pixels_first_logprob_diff"] = abs(own.logprobs[0] - other.logprobs[0])
            C["other_pixels_change_tokens"] = C["other_pixels_first_logprob_diff"] > 1e-3 or \
                own.output_ids != other.output_ids
        g = C["logprob_gap_vs_hf_bfloat16"]
        summary["ok"] = bool(C["finish_length"] == 1.0 and C["distinct_per_group"] > 1 and g["mean_abs"] < 0.05
                             and C.get("other_pixels_change_tokens", True))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":  # SGLang spawns its schedulers: the module must be importable without side effects
    sys.exit(main())
