"""SGLang's `routed_experts_start_len` on a real engine (one GPU): rows asked from start s are rows s.. of the
start-0 request, and a multi-turn trajectory ends with the same routing whether each turn asks only for its new rows
or for all of them, for a fraction of the bytes.

    source benchmarks/gpu_setup.sh && python benchmarks/gpu_routing_start_len.py --out $OUT/routing_start_len.json
    python benchmarks/gpu_routing_start_len.py --engine reference --out /tmp/routing_start_len.json   # CPU, same checks

Models: the tiny DeepSeek-V3 (examples/deepseek_v3/tiny/gpu_config.json) and the Qwen3-MoE-shaped model of
gpu_routing_replay.py (128 experts, top-8). Per model, with greedy requests one at a time:
- tail: one prompt, start 0 vs start s for s in {1, prompt/2, prompt}: same output ids, row count
  prompt + output - 1 - s (checked by `completion_from_output` against the request's start), and the share of rows
  equal to the start-0 request's rows s.. (`tail_equal_frac`; 1.0 expected: prompt rows come from the same prefill or
  the radix cache, decode rows from the same greedy decode);
- multi-turn: `--turns` turns of `--new-tokens` each with `--env-tokens` environment tokens between them, through
  `Trajectory.record_routing` exactly as the tool rollout does, once asking from `Trajectory.routing_start` and once
  from 0: same tokens, the share of equal routing rows, the rows and int32 payload bytes received per trajectory
  (`routing.received_bytes`), and the wall time of each.
Writes the JSON after every model. Exit code 1 when a row count is wrong or tokens differ.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))


def _engine(kind: str, hf: Path, routing):
    if kind == "sglang":
        from mtrain.rollout.sglang_engine import SGLangEngine
        return SGLangEngine(str(hf), tp_size=1, mem_fraction_static=0.3, random_seed=0, routing=routing)
    from mtrain.rollout import ReferenceEngine
    return ReferenceEngine.from_pretrained(str(hf), record_routing=True)


def _tail(engine, vocab: int, prompt_len: int, new_tokens: int) -> dict:
    import torch
    from mtrain.rollout.protocol import Request, SamplingParams
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    full = engine.generate([Request("tail-full-", prompt, params)])[0]
    out = {"prompt": prompt_len, "output": len(full.output_ids), "starts": {}}
    ok = True
    for s in sorted({1, prompt_len // 2, prompt_len}):
        part = engine.generate([Request(f"tail-{s}-", prompt, params, routed_experts_start=s)])[0]
        same_ids = part.output_ids == full.output_ids
        rows = part.routed_experts.shape[0]
        want = full.routed_experts[s:]
        equal = float((part.routed_experts == want).all(-1).all(-1).float().mean()) if rows == want.shape[0] else None
        out["starts"][s] = {"rows": rows, "same_output_ids": same_ids, "tail_equal_frac": equal}
        ok &= same_ids and rows == len(prompt) + len(part.output_ids) - 1 - s
    out["ok"] = ok
    return out


def _multi_turn(engine, vocab: int, args, from_zero: bool) -> tuple:
    import torch
    from mtrain.rollout.protocol import Request, SamplingParams
    from mtrain.rollout.trajectory import Segment, Trajectory
    g = torch.Generator().manual_seed(2)
    traj = Trajectory("mt-", [Segment("prompt", torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist())])
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    t0 = time.perf_counter()
    for turn in range(args.turns):
        start = 0 if from_zero else traj.routing_start
        c = engine.generate([Request(f"mt-{int(from_zero)}-{turn}-", traj.tokens, params,
                                     routed_experts_start=start)])[0]
        traj.add_model_tokens(c.output_ids, c.logprobs, c.weight_version)
        traj.record_routing(c.routed_experts, c.routed_experts_start)
        if turn + 1 < args.turns:
            traj.segments.append(Segment("env", torch.randint(3, vocab, (args.env_tokens,), generator=g).tolist()))
    return traj, time.perf_counter() - t0


def run_model(name: str, args, work: Path) -> dict:
    from gpu_routing_replay import MODELS
    from mtrain.rollout.routing import received_bytes, routing_shape
    hf = work / name / "hf"
    if not (hf / "config.json").exists():
        subprocess.run([sys.executable, "-m", "mtrain", "init-tiny", "--out", str(hf), "--seed", "0", *MODELS[name]],
                       cwd=work, check=True, stdout=subprocess.DEVNULL)
    cfg = json.loads((hf / "config.json").read_text())
    shape = routing_shape(cfg)
    engine = _engine(args.engine, hf, shape)
    try:
        rep = {"model": name, "engine": args.engine, "sglang_bytes_per_row": shape.sglang_bytes_per_token,
               "tail": _tail(engine, cfg["vocab_size"], args.prompt_len, args.new_tokens)}
        new, t_new = _multi_turn(engine, cfg["vocab_size"], args, from_zero=False)
        old, t_old = _multi_turn(engine, cfg["vocab_size"], args, from_zero=True)
        same_tokens = new.tokens == old.tokens
        eq = float((new.routed_experts == old.routed_experts).all(-1).all(-1).float().mean()) \
            if new.routed_experts.shape == old.routed_experts.shape else None
        rep["multi_turn"] = {
            "turns": args.turns, "tokens": len(new.tokens), "same_tokens": same_tokens, "routing_equal_frac": eq,
            "rows_received": {"start_len": new.routing_rows_received, "start_0": old.routing_rows_received},
            "bytes": {"start_len": received_bytes([new], shape), "start_0": received_bytes([old], shape)},
            "wall_s": {"start_len": t_new, "start_0": t_old}}
        rep["ok"] = rep["tail"]["ok"] and same_tokens and new.routed_experts.shape[0] == len(new.tokens) - 1
        return rep
    finally:
        engine.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="dsv3,qwen3moe")
    ap.add_argument("--engine", default="sglang", choices=["sglang", "reference"])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--env-tokens", type=int, default=24)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--work", default="/tmp/mtrain-routing-start-len")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results, ok = [], True
    for name in args.models.split(","):
        try:
            rep = run_model(name, args, work)
        except Exception as e:  # noqa: BLE001 - reported, the next model still runs
            rep = {"model": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
        results.append(rep)
        ok &= bool(rep.get("ok"))
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
        print(json.dumps(rep, default=str), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
