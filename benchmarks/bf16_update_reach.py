"""Which share of a model's bf16 weights an Adam step of a given learning rate can move at all.

Adam moves every element by about lr per step (its normalised update is ~1 in magnitude when gradients keep their
sign). A bf16 weight w changes only once the float32 main copy has moved past half a bf16 ulp of w:
half_ulp(w) = 2^(floor(log2 |w|) - 8). So within k steps of one sign, the elements with half_ulp(w) <= k * lr can
change. This prints that share for several learning rates and step counts, over the linear layers of a HF model
(embeddings and norms apart), read from its safetensors: the numbers the GPU recipe's learning rate is chosen from.

    python benchmarks/bf16_update_reach.py [HF_DIR]      (default: the cached SmolLM2-135M-Instruct)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LRS = (5e-6, 1e-5, 2e-5, 3e-5)
STEPS = (1, 4, 14, 28)


def half_ulps(hf_dir: Path) -> torch.Tensor:
    out = []
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name.endswith("proj.weight"):
                    w = st.get_tensor(name).to(torch.bfloat16).float().flatten()
                    w = w[w != 0]
                    out.append(torch.exp2(torch.floor(torch.log2(w.abs())) - 8))
    return torch.cat(out)


def main() -> None:
    if len(sys.argv) > 1:
        hf_dir = Path(sys.argv[1])
    else:
        from mtrain.converters.smollm2 import smollm2_hf_dir
        hf_dir = smollm2_hf_dir()
    h = half_ulps(hf_dir)
    print(f"{hf_dir}: {h.numel()} linear-layer elements; median half-ulp {float(h.median()):.3g}")
    print("share of bf16 elements an Adam update of one sign can move within k steps (half_ulp <= k * lr)")
    print("lr       " + "".join(f"k={k:<8}" for k in STEPS))
    for lr in LRS:
        print(f"{lr:<9.1e}" + "".join(f"{float((h <= k * lr).float().mean()):<10.3f}" for k in STEPS))


if __name__ == "__main__":
    main()
