"""Bytes per token of the stored routing (routing replay, docs/design-routing-replay.md) for real MoE shapes: ours
(dtype chosen from the expert count) vs SGLang's int32 payload. Pure arithmetic from the architecture tables.

    python benchmarks/routing_replay_bytes.py      # prints a markdown table
"""
import json
from pathlib import Path

from mtrain.rollout.routing import routing_shape
from mtrain.tiny_configs import tiny_config

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    rows = {
        "tiny Qwen3-MoE (tests)": tiny_config("qwen3_moe"),
        "tiny DeepSeek-V3 (tests)": tiny_config("deepseek_v3"),
        "tiny DeepSeek-V3 GPU (examples/deepseek_v3/tiny/gpu_config.json)":
            json.loads((REPO / "examples/deepseek_v3/tiny/gpu_config.json").read_text()),
        "Qwen3-30B-A3B shape": tiny_config("qwen3_moe", num_hidden_layers=48, num_experts=128, num_experts_per_tok=8),
        "Qwen3-235B-A22B shape": tiny_config("qwen3_moe", num_hidden_layers=94, num_experts=128, num_experts_per_tok=8),
        "DeepSeek-V3 671B (examples/deepseek_v3/full/config.json)":
            json.loads((REPO / "examples/deepseek_v3/full/config.json").read_text()),
        "hypothetical: 61 layers, 512 experts, top-8": tiny_config("qwen3_moe", num_hidden_layers=61, num_experts=512,
                                                                  num_experts_per_tok=8),
    }
    print("| model | layers (MoE) | experts, top-k | stored dtype | stored B/token | SGLang int32 B/token | "
          "32k-token sample stored |")
    print("|---|---|---|---|---|---|---|")
    for name, cfg in rows.items():
        s = routing_shape(cfg)
        print(f"| {name} | {s.num_layers} ({len(s.moe_layers)}) | {s.num_experts}, {s.top_k} | "
              f"{str(s.dtype).replace('torch.', '')} | {s.bytes_per_token} | {s.sglang_bytes_per_token} | "
              f"{32768 * s.bytes_per_token / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
