"""rollout.async=one_step: step N+1's groups are generated with weights N while step N trains.

Colocated placement: every engine stays resident while training runs (engine.colocate's release/resume is off), and
a thread of each rank drives a second `RolloutPool` over a gloo group of its own (the training collectives use the
default group at the same time; two threads must never share a process group). One step, on every rank:

    take(N)   the rollout of step N: generated during step N-1 (weights N-1), or now when none is pending
              (the first step, the first step after a restart)
    start(N+1) the background thread samples step N+1's prompts and runs them on the engines, which hold weights N
    ...        logprobs, update: weights N -> N+1 in the trainer only
    wait()     the background rollout is done: only now may the sync replace the engines' weights (sync point)
    sync(N+1)

So every token trained at step N >= 1 carries version N-1 (per token, `Completion.token_versions`); the update's
old policy is the trainer's recomputation under weights N, and `rollout.offpolicy` corrects for the lag: `tis`
weights each token by min(pi_trainer / pi_rollout, algo.tis_cap) (the objective does it whenever tis_cap is set),
`mask` drops tokens more than `rollout.max_staleness` (default 1) versions old from the loss.

Restart: the pending rollout is never checkpointed; the checkpoint's sampler state is the one from before the
pending rollout drew its prompts, so a restart draws them again (none lost, none trained twice). docs/design-async.md.
"""
from __future__ import annotations

import json
import threading
from datetime import timedelta
import time
from collections import Counter
from pathlib import Path

import torch.distributed as dist

from mtrain.rollout.partial import length_budget
from mtrain.rollout.pool import RolloutPool
from mtrain.run_files import LEDGER
from mtrain.trainer.generation.rollouts import RolloutResult
from mtrain.trainer.sources.base import step_seed

ONE_STEP_STALENESS = 1  # what rollout.max_staleness means for one_step when unset
# LEDGER: one line per trained step, {"step": the record's step, "prompts": dataset indices}; what a restart check
# counts (every sampled prompt trained once)


def rollout_for_step(trainer, pool: RolloutPool, step: int, drawn: dict, samples=None) -> RolloutResult:
    """Step `step`'s prompts (the sampler's next batch, or `samples` already drawn), seeds and request ids exactly as
    the synchronous loop's, run on `pool`: an async run differs from a synchronous one only in the weights that
    generated."""
    cfg = trainer.cfg
    if samples is None:
        samples = [trainer.train_set[i] for i in trainer.sampler.next_batch()]
    drawn[step] = [s.index for s in samples]  # the ledger of trained prompts (LEDGER)
    return trainer.generate(pool, samples, n=cfg.rollout.samples_per_prompt, seed=step_seed(cfg, step),
                            prefix=f"s{step}", max_new_tokens=length_budget(cfg.rollout, step))


def lag_metrics(res: RolloutResult, step: int) -> dict[str, float]:
    """Trained tokens by version lag (step - the version that generated them), as partial rollout reports them."""
    lag: Counter = Counter()
    if res.trajectories is None:
        for c in res.completions:
            lag.update(step - v for v in c.versions)
    else:
        for t in res.trajectories:
            lag.update(step - v for seg in t.segments if seg.kind == "model" for v in seg.versions)
    total = sum(lag.values())
    out = {f"rollout/tokens_lag_{k}": float(v) for k, v in sorted(lag.items())}
    out["rollout/offpolicy_token_frac"] = (total - lag[0]) / max(total, 1)
    out["rollout/version_lag_mean"] = sum(k * v for k, v in lag.items()) / max(total, 1)
    return out


def offpolicy_mask(batch, step: int, rollout_cfg) -> dict[str, float]:
    """rollout.offpolicy=mask under one_step: tokens more than max_staleness versions old leave the loss (stream
    drops whole groups instead: stream_step.drop_stale_groups)."""
    if rollout_cfg.offpolicy != "mask":
        return {}
    allowed = rollout_cfg.max_staleness if rollout_cfg.max_staleness is not None else ONE_STEP_STALENESS
    batch.response_mask[(batch.versions >= 0) & (batch.versions < step - allowed)] = 0.0
    return {}


def _ledger_step(line: str) -> float:
    """A ledger line's step; a line cut by a kill mid-write (or blank) counts as past every checkpoint."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


class OneStepRollout:
    def __init__(self, trainer):
        self.trainer = trainer
        d = trainer.decisions
        # collective on every rank, in the same order; bounded like every other collective of the run (a dead or hung
        # rank ends the job with an error within train.collective_timeout_s, not a silent hang)
        pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=trainer.cfg.train.collective_timeout_s))
        self.pool = RolloutPool(d.groups, trainer.rank, trainer.engine,
                                max_groups_in_flight=trainer.cfg.rollout.max_groups_in_flight,
                                namespace="mtrain/pool_async", process_group=pg)
        self._pending: dict | None = None  # {"step", "thread", "box", "t0"}
        self._sampler_before: dict | None = None
        self.drawn: dict[int, list[int]] = {}  # step -> dataset indices of its prompts
        self.ledger = Path(trainer.cfg.train.run_dir) / LEDGER if trainer.rank == 0 else None
        self._ledger_checked = False

    def _record_trained(self, step: int) -> None:
        """Append this step's prompts to the ledger (rank 0). The update of `step` makes weights step+1, the key of
        its record; after a restart, entries past the checkpoint's step are dropped first (they were not saved)."""
        if self.ledger is None:
            return
        if not self._ledger_checked:
            self._ledger_checked = True
            if self.ledger.exists():
                kept = [x for x in self.ledger.read_text().splitlines() if _ledger_step(x) <= step]
                self.ledger.write_text("".join(x + "\n" for x in kept))
        self.ledger.parent.mkdir(parents=True, exist_ok=True)
        with open(self.ledger, "a") as f:
            f.write(json.dumps({"step": step + 1, "prompts": self.drawn.pop(step)}) + "\n")

    # ---- the RolloutSource role (sources/base.py)
    def next_batch(self, step: int) -> RolloutResult:
        return self.step(step, self.trainer.cfg.train.steps)

    def mask_stale(self, batch, step: int) -> dict[str, float]:
        return offpolicy_mask(batch, step, self.trainer.cfg.rollout)

    def before_publish(self) -> dict[str, float]:
        return self.wait()  # the engines keep weights N until the next step's rollout is done

    def publish(self, publisher, version: int) -> dict[str, float]:
        return publisher.publish(version)

    def state_dict(self) -> dict:
        return {"sampler": self.sampler_state()}  # a pending rollout's prompts are drawn again

    def load_state_dict(self, state: dict, path) -> None:
        self.trainer.sampler.load_state_dict(state["sampler"])

    def sampler_state(self) -> dict:
        """What a checkpoint saves: the sampler as it was before the pending rollout drew its prompts."""
        return self._sampler_before if self._pending is not None else self.trainer.sampler.state_dict()

    def step(self, step: int, steps: int) -> RolloutResult:
        """This step's rollout; starts the next step's in the background unless this is the last step."""
        res = self._take(step)
        if step + 1 < steps:
            self._start(step + 1)
        return res

    def _take(self, step: int) -> RolloutResult:
        p = self._pending
        if p is None:  # nothing generated ahead: the first step, or the first after a restart
            res = rollout_for_step(self.trainer, self.pool, step, self.drawn)  # (its time is the loop's time/rollout)
        else:
            if p["step"] != step:
                raise RuntimeError(f"rollout.async: the pending rollout is for step {p['step']}, not {step}")
            p["thread"].join()
            self._pending = self._sampler_before = None
            if "error" in p["box"]:
                raise p["box"]["error"]
            res = p["box"]["result"]
            res.metrics.update(p["timing"])
        res.metrics.update(lag_metrics(res, step))
        self._record_trained(step)
        return res

    def _start(self, step: int) -> None:
        self._sampler_before = self.trainer.sampler.state_dict()
        box: dict = {}

        def run() -> None:
            t0 = time.perf_counter()
            try:
                box["result"] = rollout_for_step(self.trainer, self.pool, step, self.drawn)
            except BaseException as e:  # noqa: BLE001 - raised in the training thread by wait()/take()
                box["error"] = e
            box["seconds"] = time.perf_counter() - t0

        thread = threading.Thread(target=run, name=f"mtrain-async-rollout-s{step}", daemon=True)
        self._pending = {"step": step, "thread": thread, "box": box, "t0": time.perf_counter(), "timing": {}}
        thread.start()

    def wait(self) -> dict[str, float]:
        """The sync point: block until the background rollout is done (the engines keep weights N until then).
        Returns the overlap metrics of this step (the rollout's own metrics travel with it to the next step)."""
        p = self._pending
        if p is None:
            return {}
        t0 = time.perf_counter()
        p["thread"].join()
        end = time.perf_counter()
        if "error" in p["box"]:
            self._pending = self._sampler_before = None
            raise p["box"]["error"]
        window = end - p["t0"]  # from the start of the background rollout to the sync point
        gen = p["box"]["seconds"]
        out = {"perf/train_wait_s": end - t0,  # the trainer idle, waiting for the engines
               "perf/engine_busy_frac": min(1.0, gen / max(window, 1e-9)),  # engines generating in that window
               "perf/overlap_s": max(0.0, gen - (end - t0)),  # generation hidden behind training
               "time/rollout_background": gen}
        p["timing"] = {"time/rollout_generated_ahead": gen}
        return out
