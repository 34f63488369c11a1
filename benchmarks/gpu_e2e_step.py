"""One end-to-end table on one GPU: GRPO steps of a realistic shape against each phase's floor, all in one call.

    source benchmarks/gpu_setup.sh && python3 benchmarks/gpu_e2e_step.py --model qwen3_1_7b --out $OUT/e2e.json

1. A random-weight model of the shape's dimensions (benchmarks/configs/<model>.json; bf16, written on the GPU).
2. `mtrain train` on it, colocated, one rank: --prompts x --samples samples of up to --new-tokens response tokens per
   step, packed micro-batches, --steps steps (the first is the warm-up). The loop's metrics give each phase. The GPU's
   used memory is sampled (NVML, every 0.2 s) for the measured peak, against the memory plan preflight printed.
   --async-modes off,one_step runs the same steps once per mode (rollout.async), one after the other.
3. The floors, after the run has left the GPU, in this process:
   rollout   a standalone `sglang.Engine` with the run's server arguments, the same number of requests of the run's
             mean prompt length, --new-tokens each
   logprobs  a bare forward of the same packed micro-batches (the model alone: no schedule, no logprob, no copy back)
   train     a bare forward + backward + optimizer step of them (the chunked logprob's sum as the loss)
   sync      a device-to-device copy of the bytes the run's sync sent
   and, on the same batch, the Actor's own scoring pass and training step alone (what the loop adds is the rest),
   the old float32 logprob against the chunked one on one micro-batch's logits (time and peak memory), and a bf16
   matrix product for the machine's measured peak (MFU is given against it and against 989 TFLOP/s).
Prints the table (per phase: the run's median (min-max) over the measured steps, the floor, the ratio), the step
against the sum of the floors, MFU of the train phase, generated tokens/s/GPU, tokens/GPU/day, the trainable share.
A heartbeat line at least every 20 s.

A shape whose run and floors do not fit one 10-minute call (Qwen3-4B on an H100) is taken in two: `--part run` trains
and keeps the run's result in WORK/runs.json, `--part floors` (the next call, on the same warm machine: /tmp stays)
measures the floors against it and prints the table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

PHASES = ("time/rollout", "time/logprobs", "time/train", "time/sync", "time/release_memory", "time/resume_memory",
          "time/offload", "time/reload",  # engine.offload_train's moves of the optimizer state (0 without it)
          "time/logprobs_prepare", "time/logprobs_policy", "time/logprobs_reference")  # the last three: within logprobs
DATASHEET_TFLOPS = 989.0  # H100/H200 SXM dense bf16
T0 = time.perf_counter()
_phase = ["start"]


def say(msg: str) -> None:
    print(f"[e2e {time.perf_counter() - T0:6.0f} s] {msg}", flush=True)


def heartbeat(every: float = 20.0) -> None:
    def beat():
        while True:
            time.sleep(every)
            say(f"... {_phase[0]}")
    threading.Thread(target=beat, daemon=True).start()


class GpuMemory:
    """Peak used device memory (NVML: every process on the GPU) while `with` runs."""

    def __init__(self, period: float = 0.2):
        import pynvml
        pynvml.nvmlInit()
        self.nvml, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        self.total = pynvml.nvmlDeviceGetMemoryInfo(self.h).total
        self.period, self.peak, self.stop = period, 0, threading.Event()

    @staticmethod
    def device_name() -> str:
        import pynvml
        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return name.decode() if isinstance(name, bytes) else name

    def used(self) -> int:
        return self.nvml.nvmlDeviceGetMemoryInfo(self.h).used

    def __enter__(self):
        self.base = self.used()

        def sample():
            while not self.stop.is_set():
                self.peak = max(self.peak, self.used())
                time.sleep(self.period)
        self.t = threading.Thread(target=sample, daemon=True)
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join()


def hf_tensors(cfg: dict) -> list[tuple[str, tuple]]:
    """(name, shape) of every tensor of the model's HF checkpoint, from mtrain's layout table: the per-expert names
    SGLang and mtrain's loader read, whatever the installed transformers keeps in memory (5.x fuses the experts)."""
    from mtrain.layouts import model_layout
    out = {}
    for w in model_layout(dict(cfg, num_nextn_predict_layers=0), mtp=False).weights:
        for part in w.hf:
            out[part.name] = (part.rows[1] - part.rows[0], *w.shape[1:])
    return list(out.items())


def write_random_model(cfg_path: Path, out: Path) -> Path:
    """Random bf16 weights of the shape straight from the GPU to safetensors; norms at 1, the rest N(0, 0.02)."""
    from safetensors.torch import save_file
    cfg = json.loads(cfg_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    shard, size, n, index = {}, 0, 0, {}
    names = hf_tensors(cfg)
    for i, (name, shape) in enumerate(names):
        t = (torch.ones(shape, dtype=torch.bfloat16, device="cuda") if "norm" in name else
             (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16))
        shard[name] = t.cpu()
        size += t.numel() * 2
        if size > (2 << 30) or i == len(names) - 1:
            fname = f"model-{n:05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            index.update({k: fname for k in shard})
            shard, size, n = {}, 0, n + 1
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (out / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="bfloat16"), indent=1))
    from mtrain.tokenizer_files import write_char_tokenizer_marker
    write_char_tokenizer_marker(out, cfg["vocab_size"])  # random weights: mtrain's character tokenizer
    return out


def run_overrides(args, hf: Path) -> list[str]:
    return [f"model.hf_path={hf}", "model.dtype=bfloat16", "engine.kind=sglang",
            f"engine.mem_fraction_static={args.mem_fraction}", f"rollout.prompts_per_step={args.prompts}",
            f"rollout.samples_per_prompt={args.samples}", f"rollout.max_new_tokens={args.new_tokens}",
            "rollout.max_prompt_len=64", "rollout.temperature=1.0", f"train.max_tokens_per_micro_batch={args.budget}",
            # no KL reference model: its scoring would be a second forward in the logprob phase (the 2026-12-02 run
            # had one: GRPO's preset kl_coef=0.001) and its weights a second copy on the GPU
            "algo.kl_coef=0", *args.extra]


def run_training(args, hf: Path, run_dir: Path, mode: str) -> dict:
    overrides = run_overrides(args, hf) + [
        f"rollout.async={mode}", f"train.steps={args.steps}", "train.save_interval=-1", "train.eval_interval=0",
        f"train.run_dir={run_dir}", f"data.arithmetic.num_train={args.prompts * args.steps}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "mtrain", "train",
           str(REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"), *overrides]
    say(" ".join(cmd))
    log = run_dir.parent / f"train_{mode}.log"
    t = time.perf_counter()
    with GpuMemory() as mem, open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=str(run_dir.parent), stdout=f, stderr=subprocess.STDOUT, text=True)
        while p.poll() is None:
            time.sleep(1)
            done = len((run_dir / "metrics.jsonl").read_text().splitlines()) if (run_dir / "metrics.jsonl").exists() else 0
            _phase[0] = f"training ({mode}): {done}/{args.steps} steps logged, GPU {mem.used() / 2**30:.1f} GiB used"
    text = log.read_text()
    say(f"training ({mode}) exit {p.returncode} after {time.perf_counter() - t:.0f} s; GPU peak "
        f"{mem.peak / 2**30:.1f} GiB of {mem.total / 2**30:.1f} (before: {mem.base / 2**30:.1f})")
    plan = next((line for line in text.splitlines() if line.startswith("memory plan per GPU:")), None)
    if p.returncode:
        print(text[-5000:], flush=True)
        raise SystemExit(f"training ({mode}) failed: exit {p.returncode} (log {log})")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"metrics": metrics, "gpu_peak_bytes": mem.peak, "gpu_base_bytes": mem.base, "gpu_total": mem.total,
            "plan_line": plan}


def rollout_floor(args, hf: Path, prompt_len: int, n: int) -> dict:
    """A standalone sglang.Engine with the server arguments the run's engine got, n requests of --new-tokens."""
    from gpu_engine_parity import run_standalone
    from mtrain.config import load_config
    from mtrain.trainer.engines import engine_concurrency, production_server_args
    cfg = load_config(str(REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"), run_overrides(args, hf))
    # the run keeps at most engine_concurrency requests in flight (its decode graphs go that far): so does the
    # floor (given all 256 at once, SGLang decoded past its captured graphs at half the run's rate, 2026-12-06)
    extra = {"dtype": "bfloat16", **production_server_args(cfg), "max_running_requests": engine_concurrency(cfg)}
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    return run_standalone(str(hf), extra, [n], args.new_tokens, args.floor_repeats, vocab,
                          mem_fraction=args.mem_fraction, prompt_len=prompt_len)


def _sync() -> None:
    if torch.cuda.is_available():  # the trainer floors also run on CPU (a smoke check with a tiny model)
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up: kernels, Adam state, allocator
    out = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t)
    return out


def old_logprobs(logits, tokens, vocab, temperature):
    """The scoring's logprob before mtrain/models/token_logprobs.py (float32 [tokens x vocab] copies), for the A/B."""
    from megatron.core import tensor_parallel
    lg = logits[:, :-1].float() / max(temperature, 1e-6)
    if lg.shape[-1] > vocab:
        lg = lg.masked_fill(torch.arange(lg.shape[-1], device=lg.device) >= vocab, float("-inf"))
    return -tensor_parallel.vocab_parallel_cross_entropy(lg.contiguous(), tokens[:, 1:].contiguous())


def trainer_floors(args, hf: Path, prompt_len: int, response_len: int, n: int) -> dict:
    from bench_train_throughput import make_batch, single_process_env
    from mtrain.config import load_config
    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.models.token_logprobs import token_logprobs
    from mtrain.trainer.learner.actor import Actor
    from mtrain.trainer.engines import weight_loader
    single_process_env()
    cfg = load_config(str(REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"), run_overrides(args, hf))
    init_distributed(seed=1)
    hf_cfg = json.loads((hf / "config.json").read_text())
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    actor = Actor(cfg, hf_cfg, load_weights=weight_loader(cfg, model_layout(hf_cfg, mtp=False), 0))
    batch = make_batch([(prompt_len, response_len)] * n, hf_cfg["vocab_size"], seed=0)
    micro = actor._micro(batch, {})
    model, vocab, temp = actor.chunks[0], hf_cfg["vocab_size"], cfg.rollout.temperature
    out = {"micro_batches": len(micro), "tokens": int(batch.seq_lens.sum())}

    def forward(mb):
        return model(mb["tokens"], mb["position_ids"], None, packed_seq_params=mb["packed_seq_params"])

    def bare_forward():
        model.eval()
        with torch.no_grad():
            for mb in micro:
                forward(mb)

    def bare_train():
        model.train()
        model.zero_grad_buffer()
        actor.optimizer.zero_grad()
        for mb in micro:
            lp = token_logprobs(forward(mb)[:, :-1], mb["tokens"][:, 1:], vocab, temp)
            (-lp.sum() / out["tokens"]).backward()
        actor.optimizer.step()

    adv = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0)) * batch.response_mask
    norms = {"num_tokens": float(batch.response_mask.sum()), "num_seqs": float(batch.size)}
    old = [None]

    def scoring():
        old[0] = actor.logprobs(batch)

    def actor_train():
        actor.train_step(batch, old[0], adv, None, norms)

    timings = [("bare_forward", bare_forward), ("actor_logprobs", scoring), ("bare_train", bare_train)]
    if args.actor_train:  # the Actor's step alone: ~16 s per repeat on the 1.7B shape, past one 10-minute call
        timings.append(("actor_train_step", actor_train))
    for name, fn in timings:
        _phase[0] = f"trainer floor: {name}"
        out[name] = timed(fn, args.floor_repeats)
        say(f"{name}: {statistics.median(out[name]):.3f} s median of {out[name]}")
    if not torch.cuda.is_available():
        return out
    out["trainer_peak_allocated"] = torch.cuda.max_memory_allocated()
    out["trainer_peak_reserved"] = torch.cuda.max_memory_reserved()
    # the old float32 logprob against the chunked one, on one micro-batch's logits
    try:
        out["logprob_ab"] = logprob_ab(model, micro[0], forward, vocab, temp)
    except Exception as e:  # noqa: BLE001 -- e.g. the old path's float32 copies do not fit next to the trainer
        out["logprob_ab"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        say(f"logprob A/B: {out['logprob_ab']['error']}")
    return out


def logprob_ab(model, mb, forward, vocab: int, temp: float) -> dict:
    from mtrain.models.token_logprobs import token_logprobs
    with torch.no_grad():
        model.eval()
        logits = forward(mb)
        ab = {"tokens": int(logits.shape[1]), "vocab": int(logits.shape[-1])}
        for name, fn in (("old_float32", lambda: old_logprobs(logits, mb["tokens"], vocab, temp)),
                         ("chunked", lambda: token_logprobs(logits[:, :-1], mb["tokens"][:, 1:], vocab, temp))):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            ab[name + "_s"] = timed(fn, 5)
            ab[name + "_extra_peak_bytes"] = torch.cuda.max_memory_allocated() - base
        a, b = old_logprobs(logits, mb["tokens"], vocab, temp), token_logprobs(logits[:, :-1], mb["tokens"][:, 1:],
                                                                             vocab, temp)
        ab["max_abs_diff"] = float((a - b).abs().max())
    say(f"logprob A/B on {ab['tokens']} tokens: old {statistics.median(ab['old_float32_s']) * 1e3:.1f} ms "
        f"(+{ab['old_float32_extra_peak_bytes'] / 2**30:.2f} GiB), chunked {statistics.median(ab['chunked_s']) * 1e3:.1f}"
        f" ms (+{ab['chunked_extra_peak_bytes'] / 2**30:.2f} GiB), max |diff| {ab['max_abs_diff']:.2e}")
    return ab


def copy_floor(nbytes: int, repeats: int = 5) -> list[float]:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), repeats)  # freed on return, before the trainer floors


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ts = timed(lambda: [a @ b for _ in range(10)], 3)
    return 10 * 2 * 8192 ** 3 / statistics.median(ts) / 1e12


def train_flops(hf: dict, seq_lens: list[int]) -> float:
    """Forward + backward FLOPs of a batch: 6 x matmul parameters (the head included, the embedding lookup not) per
    token, plus causal attention (QK^T and PV: 2 x 2 x L^2/2 x heads x head_dim per layer, x3 for the backward)."""
    h, L = hf["hidden_size"], hf["num_hidden_layers"]
    heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim") or h // heads
    per_layer = h * (heads + 2 * kv) * hd + heads * hd * h + 3 * h * hf["intermediate_size"]
    matmul = L * per_layer + hf["vocab_size"] * h
    tokens = sum(seq_lens)
    attn = sum(2 * 2 * (s * s / 2) * heads * hd for s in seq_lens) * L
    return 6 * matmul * tokens + 3 * attn


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_1_7b", help="benchmarks/configs/NAME.json")
    ap.add_argument("--work", default=None, help="default /tmp/e2e-MODEL")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=4096, help="train.max_tokens_per_micro_batch")
    ap.add_argument("--steps", type=int, default=4, help="training steps; the first is the warm-up")
    ap.add_argument("--mem-fraction", type=float, default=0.5, help="engine.mem_fraction_static")
    ap.add_argument("--async-modes", default="off", help="rollout.async modes, one run each (the table: the first)")
    ap.add_argument("--floor-repeats", type=int, default=2, help="timed repeats of each floor, after a warm-up")
    ap.add_argument("--actor-train", action="store_true", help="also time the Actor's training step alone")
    ap.add_argument("--no-floors", action="store_true", help="the run(s) only: no floors, no table against them")
    ap.add_argument("--part", choices=("all", "run", "floors"), default="all",
                    help="run: train and keep the result in WORK/runs.json; floors: the floors against that result")
    ap.add_argument("--write-only", action="store_true", help="write the random model into --work and stop")
    ap.add_argument("--out", default=None)
    ap.add_argument("extra", nargs="*", help="further a.b.c=value overrides for the run and the trainer floors")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    heartbeat()
    work = Path(args.work or f"/tmp/e2e-{args.model}")
    hf = work / "hf"
    if not (hf / "mtrain_char_tokenizer.json").exists():
        _phase[0] = "writing the random model"
        if args.write_only:
            write_random_model(REPO / "benchmarks" / "configs" / f"{args.model}.json", hf)
            say(f"random model written to {hf}")
        else:  # in a process of its own: this one holds no CUDA context beside the run it measures
            subprocess.run([sys.executable, __file__, "--model", args.model, "--work", str(work), "--write-only"],
                           check=True)
    if args.write_only:
        return
    hf_cfg = json.loads((hf / "config.json").read_text())
    n = args.prompts * args.samples
    # the device's name from NVML: this process stays off CUDA while the run trains (a context is GPU memory)
    res = {"config": vars(args), "device": GpuMemory.device_name(), "runs": {}}
    kept = work / "runs.json"
    if args.part == "floors":
        if not kept.exists():
            raise SystemExit(f"--part floors: no {kept} (run --part run first, on this machine)")
        res["runs"] = json.loads(kept.read_text())["runs"]
        say(f"the run's result from {kept}: modes {', '.join(res['runs'])}")
        if args.async_modes.split(",")[0] not in res["runs"]:
            raise SystemExit(f"--part floors: {kept} holds runs of {', '.join(res['runs'])}, not "
                             f"{args.async_modes.split(',')[0]} (give the --async-modes of the run part)")
    for mode in args.async_modes.split(",") if args.part != "floors" else ():
        run_dir = work / f"run_{mode}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        run_dir.mkdir(parents=True)
        r = run_training(args, hf, run_dir, mode)
        steps = [m for m in r["metrics"] if "time/step" in m][1:]  # the first step is the warm-up
        r["steps"] = steps
        r["phases"] = {k: spread([m.get(k, 0.0) for m in steps]) for k in PHASES + ("time/step",)}
        res["runs"][mode] = r
        say(f"{mode}: step {r['phases']['time/step']['median']:.2f} s median over {len(steps)} steps")
        kept.write_text(json.dumps(res, indent=1, default=str))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    first = res["runs"][args.async_modes.split(",")[0]]
    steps = first["steps"]
    gen_tokens = [m["response_len/mean"] * n for m in steps]
    prompt_len = round(statistics.mean(m["prompt_len/mean"] for m in steps))
    response_len = round(statistics.mean(m["response_len/mean"] for m in steps))
    lines = []
    if not args.no_floors and args.part != "run":
        _phase[0] = "rollout floor: standalone SGLang engine"
        try:
            roll = rollout_floor(args, hf, prompt_len, n)
            say(f"rollout floor: {roll[str(n)]}")
        except Exception as e:  # noqa: BLE001 -- the other floors are still worth their device time
            roll = {"error": f"{type(e).__name__}: {e}"}
            say(f"rollout floor failed: {roll['error']}")
        _phase[0] = "copy and matmul floors"
        sync_bytes = int(statistics.median(m["sync/bytes"] for m in steps))
        cp = copy_floor(sync_bytes)
        tflops = matmul_tflops()
        torch.cuda.empty_cache()
        say(f"copy of {sync_bytes / 2**30:.2f} GiB: {statistics.median(cp) * 1e3:.1f} ms; bf16 matmul {tflops:.0f} TFLOP/s")
        tr = trainer_floors(args, hf, prompt_len, response_len, n)
        res["floors"] = {"rollout": roll, "trainer": tr, "sync_copy_s": cp, "matmul_tflops": tflops,
                         "sync_bytes": sync_bytes}
        f = {"rollout": statistics.mean(gen_tokens) / roll[str(n)]["median_tok_s"] if str(n) in roll else float("nan"),
             "logprobs": statistics.median(tr["bare_forward"]), "train": statistics.median(tr["bare_train"]),
             "sync": statistics.median(cp)}
        ph = first["phases"]
        logprob_run = spread([m["time/logprobs"] - m.get("time/release_memory", 0.0) for m in steps])
        rows = [("rollout", ph["time/rollout"], f["rollout"]), ("logprobs", logprob_run, f["logprobs"]),
                ("train", ph["time/train"], f["train"]), ("sync", ph["time/sync"], f["sync"]),
                ("release memory", ph["time/release_memory"], None), ("resume memory", ph["time/resume_memory"], None),
                ("offload", ph["time/offload"], None), ("reload", ph["time/reload"], None),
                ("step", ph["time/step"], sum(f.values()))]
        lines.append(f"{'phase':<16}{'run median (min-max) s':>30}{'floor s':>10}{'ratio':>8}")
        for label, s, floor in rows:
            ratio = f"{s['median'] / floor:.2f}" if floor else "-"
            lines.append(f"{label:<16}{s['median']:>12.3f} ({s['min']:.3f}-{s['max']:.3f})  {(floor or 0):>10.3f}"
                         f"{ratio:>8}")
        lines.append(f"scoring alone (Actor.logprobs, same batch): {statistics.median(tr['actor_logprobs']):.3f} s")
        lines.append("within the run's logprob phase: " + ", ".join(
            f"{k.split('_', 1)[1]} {ph[k]['median']:.3f} ({ph[k]['min']:.3f}-{ph[k]['max']:.3f})"
            for k in ("time/logprobs_prepare", "time/logprobs_policy", "time/logprobs_reference")))
        flops = train_flops(hf_cfg, [prompt_len + response_len] * n)
        mfu = [flops / m["time/train"] / 1e12 for m in steps]
        res.update(floor_s=f, step_over_floors=ph["time/step"]["median"] / sum(f.values()),
                   logprob_over_floor=logprob_run["median"] / f["logprobs"], train_tflops=spread(mfu),
                   mfu_vs_measured=statistics.median(mfu) / tflops, mfu_vs_datasheet=statistics.median(mfu)
                   / DATASHEET_TFLOPS)
        lines.append(f"train phase: {statistics.median(mfu):.0f} TFLOP/s ({min(mfu):.0f}-{max(mfu):.0f}); MFU "
                     f"{res['mfu_vs_datasheet']:.3f} of {DATASHEET_TFLOPS:.0f}, {res['mfu_vs_measured']:.3f} of the "
                     f"measured {tflops:.0f} TFLOP/s matmul")
    tps = spread([g / m["time/step"] for g, m in zip(gen_tokens, steps)])
    res["tokens_per_s_per_gpu"] = tps
    # the generated tokens that enter the loss: every response of the groups kept (algo.filter_uniform_groups drops
    # groups of equal rewards and logs filter/kept_groups; without it every group is kept)
    res["trainable_share"] = statistics.mean(m.get("filter/kept_groups", args.prompts) / args.prompts for m in steps)
    lines.append(f"end to end: {tps['median']:.0f} generated tokens/s/GPU ({tps['min']:.0f}-{tps['max']:.0f}) = "
                 f"{tps['median'] * 86400 / 1e6:.1f} M tokens/GPU/day; {n} samples x {response_len} response tokens "
                 f"(mean), prompt {prompt_len}; trainable share {res['trainable_share']:.2f}")
    if "step_over_floors" in res:
        lines.append(f"step / sum of floors = {res['step_over_floors']:.2f} (goal <= 1.15); logprob pass / bare "
                     f"forward = {res['logprob_over_floor']:.2f} (goal <= 1.1)")
    for mode, r in res["runs"].items():
        lines.append(f"{mode}: step {r['phases']['time/step']['median']:.2f} s ({r['phases']['time/step']['min']:.2f}-"
                     f"{r['phases']['time/step']['max']:.2f}); GPU peak {r['gpu_peak_bytes'] / 2**30:.1f} GiB measured"
                     f" (NVML), plan: {(r['plan_line'] or 'none printed').split('; peak ')[-1]}")
    print("\n".join(lines), flush=True)
    res["table"] = lines
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
