"""The feature matrix of `mtrain train` (issue 42): a cell is one value per axis; `overrides(cell)` turns it into the
command line of a real run, `check_run` reads that run's metrics and holds it to what every cell must show.

Axes (values in the order the ids use them):
    rollout     off | partial | one_step | stream
    generation  single (one turn) | tools (multi-turn calculator) | agent (OpenAI-front agents, serve.agent)
    learner     grpo | ppo (critic) | distill (teacher)
    lora        off | on (attention and MLP linears; attention only on a MoE) | experts (and the routed experts)
    routing     off | replay (algo.routing_replay=rollout on a MoE)
    placement   colocated (2 ranks) | separate engine.tp 1 | separate engine.tp 2 (2 training + 2 engine ranks)

Every cell: tiny random models in float32, CPU reference engines, gloo, 2 steps; step 1's engine-vs-trainer logprob
gap <= 1e-5 (the engines generated with exactly the weights the trainer scores with); every trained token's version
within the mode's staleness bound. Cells of rollout.async one_step / stream are also SIGKILLed after step 1's
checkpoint and resumed: their ledger of trained prompts (mtrain/run_files.py LEDGER) must hold every prompt the
sampler handed out exactly once. The synchronous sources keep no ledger; their exact resume is
tests/trainer/test_separate_restart.py and test_loop_torchrun.py.
"""
from __future__ import annotations

import itertools
import json
import re
import subprocess
import time
from dataclasses import dataclass, fields
from pathlib import Path

from loop_harness import SIGNAL_REWARD, base_overrides, env, kill_job, torchrun_cmd, train_records

AXES = {
    "rollout": ("off", "partial", "one_step", "stream"),
    "generation": ("single", "tools", "agent"),
    "learner": ("grpo", "ppo", "distill"),
    "lora": ("off", "on", "experts"),
    "routing": ("off", "replay"),
    "placement": ("colocated", "separate_tp1", "separate_tp2"),
}
AGENT = f"{Path(__file__).resolve().parent / 'agents_for_tests.py'}:two_turn_digits"
GAP = 1e-5  # float32 on both sides: what a correct sync leaves (docs/design-trainer.md, "Logprobs")
PROMPTS, SAMPLES = 2, 2


@dataclass(frozen=True)
class Cell:
    rollout: str = "off"
    generation: str = "single"
    learner: str = "grpo"
    lora: str = "off"
    routing: str = "off"
    placement: str = "colocated"

    def __post_init__(self):
        for f in fields(self):
            assert getattr(self, f.name) in AXES[f.name], (f.name, getattr(self, f.name))

    @property
    def moe(self) -> bool:  # expert adapters and routing replay need routed experts
        return self.lora == "experts" or self.routing == "replay"

    @property
    def separate(self) -> bool:
        return self.placement != "colocated"

    @property
    def nproc(self) -> int:
        return 4 if self.separate else 2

    @property
    def killed(self) -> bool:
        """Cells whose source keeps the ledger of trained prompts are killed and resumed once."""
        return self.rollout in ("one_step", "stream")

    @property
    def id(self) -> str:
        return "-".join(f"{getattr(self, f.name)}" for f in fields(self))


# ---- what is refused today, and why: ONE list. Each entry: (the refused key, which cells it refuses, a pattern of
# the run's error). A cell matching an entry is xfail(strict) and must fail with that very error
# (KnownRefusal); failing any other way is a real bug. Remove an entry once its refusal is gone: its cells then run.
# Empty: every cell of the matrix runs (LoRA with separate placement, stream and experts; agents and engine.tp 2
# with separate placement).
REFUSED_TODAY: list = []


def refusals(cell: Cell) -> list[tuple[str, str]]:
    return [(key, pattern) for key, hits, pattern in REFUSED_TODAY if hits(cell)]


# ---- combinations refused by design (not planned): left out of the matrix, their pairs not required. Each is a
# config check (mtrain/job_split.check_async, config_checks); tests/trainer/test_matrix.py asserts they still are
# refused, so a combination that starts running shows up there and moves into the matrix.
EXCLUDED = [
    ("serve.agent with rollout.partial (agents drive their own turns)",
     lambda c: c.generation == "agent" and c.rollout == "partial", Cell(rollout="partial", generation="agent"),
     r"serve\.agent: agents drive their own turns"),
]


def excluded(cell: Cell) -> bool:
    return any(hits(cell) for _, hits, _, _ in EXCLUDED)


# ---- the pairwise covering set
def _pairs(cell: Cell) -> set:
    vals = [(f.name, getattr(cell, f.name)) for f in fields(cell)]
    return set(itertools.combinations(vals, 2))


def _cost(cell: Cell) -> int:
    """Relative wall time on 2 cores: the greedy choice takes the cheapest of equally covering cells."""
    return (2 if cell.separate else 0) + (2 if cell.generation == "tools" else 0) + cell.moe + cell.killed


def pairwise_cells() -> list[Cell]:
    """Greedy covering set: every pair of values of two axes that some allowed cell holds appears in some chosen
    cell. Pairs that cells running today can hold are covered by such cells first, so no pair is tested only inside
    a cell that fails for another pair's refusal; the pairs refused today (REFUSED_TODAY) come after, in as few
    cells as the greedy finds. Deterministic: the cell covering the most uncovered pairs, the cheaper on a tie, then
    the first in product order."""
    allowed = [Cell(*v) for v in itertools.product(*AXES.values())]
    allowed = [c for c in allowed if not excluded(c)]
    runs = [c for c in allowed if not refusals(c)]
    chosen: list[Cell] = []
    need = set().union(*(_pairs(c) for c in allowed))
    for pool in (runs, allowed):
        while need & set().union(*(_pairs(c) for c in pool)):
            best = max(pool, key=lambda c: (len(_pairs(c) & need), -_cost(c)))
            chosen.append(best)
            need -= _pairs(best)
    assert not need, need
    return chosen


# ---- a cell as `mtrain train` overrides
def models(root: Path) -> dict[str, Path]:
    """Tiny random students and teachers (another seed, the same vocabulary); 1024 positions: the tools' system
    prompt alone is ~500 characters of the char tokenizer."""
    from mtrain.tiny_hf import write_tiny_hf
    pos = {"max_position_embeddings": 1024}
    return {f"{arch}/{role}": write_tiny_hf(arch, root / arch / role, seed=seed, overrides=pos)
            for arch in ("llama", "qwen3_moe") for role, seed in (("student", 0), ("teacher", 1))}


def overrides(cell: Cell, hf: dict[str, Path], run_dir: Path) -> list[str]:
    arch = "qwen3_moe" if cell.moe else "llama"
    o: dict = {"train.steps": 2, "train.save_interval": 1 if cell.killed else -1, "train.micro_batch_size": 2,
               "rollout.prompts_per_step": PROMPTS, "rollout.samples_per_prompt": SAMPLES, "model.dtype": "float32",
               "reward.fn": SIGNAL_REWARD,
               # MoE trains at TP1 with EP2 without Transformer Engine (docs/design-trainer.md)
               "parallel.tp": 1 if cell.moe else 2, "parallel.ep": 2 if cell.moe else 1}
    if cell.rollout == "partial":
        o.update({"rollout.partial": "true", "rollout.over_sample": 2, "rollout.max_staleness": 1})
    elif cell.rollout != "off":
        o.update({"rollout.async": cell.rollout, "rollout.max_staleness": 1})
    if cell.generation == "tools":
        o.update({"multi_turn.rollout_fn": "mtrain.rollout.agents.multi_turn:rollout_group",
                  "multi_turn.tools": "calculator", "multi_turn.max_turns": 2, "multi_turn.max_total_tokens": 700,
                  "rollout.max_prompt_len": 600})
    elif cell.generation == "agent":
        o["serve.agent"] = AGENT
    if cell.learner == "ppo":
        o.update({"algo.name": "ppo", "critic.lr": 1e-3, "critic.warmup_steps": 0})
    elif cell.learner == "distill":
        o["algo.distill.teacher_path"] = hf[f"{arch}/teacher"]
    if cell.lora != "off":
        # a MoE (here for routing replay) has no dense MLP for gate_up/down: attention only, or with its experts
        mlp = {"experts": ",experts", "on": "" if cell.moe else ",gate_up,down"}[cell.lora]
        targets = "qkv,o_proj" + mlp
        o.update({"model.lora.targets": targets, "model.lora.rank": 4, "model.lora.alpha": 8, "model.lora.lr": 1e-3})
    if cell.routing == "replay":
        o["algo.routing_replay"] = "rollout"
    if cell.separate:
        o.update({"engine.placement": "separate", "engine.ranks": 2, "engine.tp": int(cell.placement[-1])})
    return base_overrides(hf[f"{arch}/student"], run_dir, **o)


class KnownRefusal(Exception):
    """The run stopped with one of REFUSED_TODAY's errors."""


def _run(cmd: list[str], cwd: Path, cell: Cell, timeout: float) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        out = p.stdout + p.stderr
        errors = sorted(set(re.findall(r"mtrain: error: .*", out)))
        for key, pattern in refusals(cell):
            if any(re.search(pattern, e) for e in errors):
                raise KnownRefusal(f"refused today: {key}: {errors}")
        raise AssertionError(f"{cell.id}: exit {p.returncode}\n{' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


def _kill_after(cmd: list[str], cwd: Path, marker: Path, timeout: float) -> None:
    """SIGKILL every process of the job once `marker` exists; a run that ends first failed (steps=2, kill at 1)."""
    log = cwd / "killed_run.err"  # a file, not a pipe: a full pipe would stall the job before the marker
    with open(log, "w") as err:
        p = subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not marker.exists():
            if p.poll() is not None:
                raise AssertionError(f"exit {p.returncode} before {marker} appeared\n{' '.join(cmd)}\n"
                                     f"{log.read_text()[-6000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{marker} did not appear within {timeout} s")
            time.sleep(0.05)
    finally:
        kill_job(p)


def run_cell(cell: Cell, hf: dict[str, Path], tmp: Path, timeout: float = 600) -> dict:
    """Run the cell (killed after step 1's checkpoint and resumed, for the ledger's sources); return what
    check_run needs."""
    run = tmp / "run"
    cmd = torchrun_cmd(overrides(cell, hf, run), cell.nproc)
    t0 = time.monotonic()
    if cell.killed:
        try:
            _kill_after(cmd, tmp, run / "checkpoints" / "step_1" / "COMPLETE", timeout)
        except AssertionError as e:  # a refusal stops the first launch already
            errors = re.findall(r"mtrain: error: .*", (tmp / "killed_run.err").read_text())
            for key, pattern in refusals(cell):
                if any(re.search(pattern, x) for x in errors):
                    raise KnownRefusal(f"refused today: {key}") from e
            raise
    p = _run(cmd, tmp, cell, timeout)
    return {"run": run, "stdout": p.stdout, "wall_s": time.monotonic() - t0}


def check_run(cell: Cell, out: dict) -> dict[int, dict]:
    run = out["run"]
    recs = train_records(run)
    assert sorted(recs) == [1, 2], sorted(recs)
    for s in (1, 2):
        assert recs[s]["weight_version"] == s, recs[s]
    gap = recs[1]["logprob_diff/max_abs"]
    assert gap <= GAP, f"{cell.id}: step-1 engine-vs-trainer logprob gap {gap} > {GAP}"
    if cell.rollout == "off":  # synchronous: step 2 is on-policy as well
        assert recs[2]["logprob_diff/max_abs"] <= GAP, recs[2]["logprob_diff/max_abs"]
    _check_versions(cell, recs)
    _check_learner(cell, recs)
    if cell.killed:
        assert "resumed from" in out["stdout"] and "at step 1" in out["stdout"], out["stdout"][-2000:]
        _check_ledger(run)
    return recs


def _lags(rec: dict) -> dict[int, float]:
    return {int(k.rsplit("_", 1)[1]): v for k, v in rec.items() if k.startswith("rollout/tokens_lag_") and v > 0}


def _check_versions(cell: Cell, recs: dict[int, dict]) -> None:
    """Trained tokens by version lag, as the run counted them: none at step 1 older than the weights it trains
    (every mode starts from weights 0), none ever past the mode's bound (off: 0; the others: rollout.max_staleness,
    set to 1 in every cell)."""
    bound = 0 if cell.rollout == "off" else 1
    for s, rec in recs.items():
        lags = _lags(rec)
        if cell.rollout != "off":
            assert lags, f"step {s}: no per-token version counts in {sorted(rec)}"
        assert max(lags, default=0) <= (0 if s == 1 else bound), (s, lags)
        if cell.rollout == "stream":
            assert rec["rollout/staleness_max"] <= bound and rec["rollout/stale_groups_dropped"] == 0, rec


def _check_learner(cell: Cell, recs: dict[int, dict]) -> None:
    """Each axis value left its own trace in each step that trained tokens (a cell that silently ran plain GRPO
    would fail here). Partial rollout trains resumed groups first: a step whose trained tokens all come from older
    weights masks them all (rollout.offpolicy=mask) and reports no loss terms, which is by design."""
    for s, r in recs.items():
        if cell.rollout == "partial" and not r.get("rollout/tokens_lag_0"):
            assert s > 1 and "logprob_diff/max_abs" not in r, (s, r)
            continue
        if cell.learner == "ppo":
            assert r["ppo/updates"] >= 1 and r["critic/grad_norm"] > 0, (s, r)
        if cell.learner == "distill":
            # the mean of log p_student - log p_teacher over the sampled tokens: an estimate that may be negative
            kl = r["distill/reverse_kl"]
            assert kl == kl and kl != 0.0, (s, r)
        if cell.lora != "off":
            assert r["sync/adapters_only"] == 1.0, (s, r)
        if cell.routing == "replay":  # tokens of older weights were routed by those: the bound is for fresh ones
            fresh = s == 1 or cell.rollout == "off"
            assert 0.0 <= r["routing/disagreement"] < (0.01 if fresh else 1.0), (s, r)
        if cell.generation == "tools":
            assert any(k.startswith("tools/") for k in r), (s, sorted(r))
        if cell.generation == "agent":
            assert r["session/calls"] == 2.0, (s, r)


def _check_ledger(run: Path) -> None:
    """0 prompts lost, 0 trained twice: the ledger after the resume against an independent replay of the sampler
    (data.seed 0, shuffled, the config's 256 arithmetic prompts)."""
    from mtrain.data.sampler import PromptSampler
    ledger = [json.loads(x) for x in (run / "trained_prompts.jsonl").read_text().splitlines() if x.strip()]
    assert [e["step"] for e in ledger] == [1, 2], ledger
    sampler = PromptSampler(256, PROMPTS, seed=0, shuffle=True)
    expected = [i for _ in range(2) for i in sampler.next_batch()]
    trained = [i for e in ledger for i in e["prompts"]]
    assert trained == expected, f"trained {trained}, sampled {expected}"
