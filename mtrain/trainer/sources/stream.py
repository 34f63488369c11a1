"""rollout.async=stream: the engines generate continuously; weight updates pause them in place instead of waiting.

A generator thread of each rank drives its own `RolloutPool` (its own gloo group, as one_step's) through one batch
after another: batch s is step s's prompts (the sampler's next batch, the synchronous loop's seeds and request ids),
started as soon as the previous batch is done and the engines hold weights >= s - K (K = rollout.max_staleness,
null = 1). The training thread takes batch s at step s, in the order the batches finished (FIFO), and after the
update it syncs the new weights *into the running generation*: each engine pauses between two decoding steps
(`RolloutEngine.pause_in_place`), the sync writes the weights (its finish keeps the KV of the paused requests),
and the same requests continue; their later tokens carry the new version (Completion.token_versions).

Staleness: a token of batch s comes from weights >= the version the engines held when batch s started >= s - K, and
is trained at step s: never more than K versions old. The generator waits rather than start a batch that could break
the bound, so no group is ever dropped or regenerated for staleness; `drop_stale_groups` still takes out of the loss
any group with an older token (counted: rollout/stale_groups_dropped, 0 by construction).

The thread uses only the pool and the engine protocol (pause_in_place / continue_generation / aborted_requests), not
the placement: with engines on ranks of their own (engine.placement=separate) it is the same loop; only the engine
ranks pause, after a barrier that the training ranks reach once their update is done.

Restart: batches generated but not trained are never checkpointed; the checkpoint's sampler state is the one before
the oldest of them drew its prompts, so a restart draws them again (none lost, none trained twice), as one_step.
docs/design-async.md.
"""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from mtrain.trainer.sources.one_step import OneStepRollout, lag_metrics, rollout_for_step
from mtrain.trainer.generation.rollouts import RolloutResult

STREAM_STALENESS = 1  # rollout.max_staleness when unset


def staleness_bound(rollout_cfg) -> int:
    return rollout_cfg.max_staleness if rollout_cfg.max_staleness is not None else STREAM_STALENESS


def drop_stale_groups(batch, step: int, rollout_cfg, group_size: int) -> dict[str, float]:
    """Groups with a token more than max_staleness versions old leave the loss (their rows' response mask is 0)."""
    versions = batch.versions
    live = versions >= 0
    lag = torch.where(live, step - versions, torch.zeros_like(versions))
    rows_max = lag.max(dim=1).values if lag.numel() else torch.zeros(batch.size, dtype=torch.long)
    groups = rows_max.view(-1, group_size).max(dim=1).values
    stale = groups > staleness_bound(rollout_cfg)
    batch.response_mask[stale.repeat_interleave(group_size)] = 0.0
    n_tokens = int(live.sum())
    return {"rollout/stale_groups_dropped": float(stale.sum()),
            "rollout/staleness_max": float(lag[live].max()) if n_tokens else 0.0,
            "rollout/staleness_mean": float(lag[live].float().mean()) if n_tokens else 0.0}


class StreamRollout(OneStepRollout):
    """The generator thread, the FIFO of finished batches and the in-place update (the ledger and the background
    pool are one_step's)."""

    def __init__(self, trainer):
        super().__init__(trainer)
        self.bound = staleness_bound(trainer.cfg.rollout)
        self.version = 0  # what the engines hold: the first step's (after a resume, its step), then set by update
        self._cv = threading.Condition()
        self._sampler_lock = threading.Lock()  # a checkpoint reads the sampler while the generator draws
        self._ready: dict[int, RolloutResult] = {}
        self._before: dict[int, dict] = {}  # drawn, not yet trained: step -> sampler state before its draw
        self._busy: list[list[float]] = []  # [start, end or None] of every batch the generator ran
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._window = time.perf_counter()
        self._aborts_seen = trainer.engine.aborted_requests if trainer.engine is not None else 0

    def mask_stale(self, batch, step: int) -> dict[str, float]:
        # whole groups with a too-old token leave the loss (counted)
        return drop_stale_groups(batch, step, self.trainer.cfg.rollout, self.trainer.cfg.rollout.samples_per_prompt)

    def publish(self, publisher, version: int) -> dict[str, float]:
        return self.update(publisher, version)  # into the running generation

    def sampler_state(self) -> dict:
        with self._sampler_lock:
            if self._before:
                return self._before[min(self._before)]
            return self.trainer.sampler.state_dict()

    def step(self, step: int, steps: int) -> RolloutResult:
        if self._thread is None:
            self.version = step
            self._thread = threading.Thread(target=self._generate, args=(step, steps), daemon=True,
                                            name="mtrain-stream-rollout")
            self._thread.start()
        t0 = time.perf_counter()
        with self._cv:
            while step not in self._ready and self._error is None:
                self._cv.wait(timeout=1.0)
            if step not in self._ready:
                raise self._error  # type: ignore[misc]
            res = self._ready.pop(step)
        with self._sampler_lock:
            self._before.pop(step)
        res.metrics["perf/train_wait_s"] = time.perf_counter() - t0  # the trainer idle, waiting for a batch
        res.metrics.update(lag_metrics(res, step))
        self._record_trained(step)
        return res

    def _generate(self, first: int, steps: int) -> None:
        try:
            for s in range(first, steps):
                with self._cv:
                    while self.version < s - self.bound:  # the staleness bound: wait for newer weights
                        self._cv.wait()
                with self._sampler_lock:
                    self._before[s] = self.trainer.sampler.state_dict()
                    samples = [self.trainer.train_set[i] for i in self.trainer.sampler.next_batch()]
                span = [time.perf_counter(), None]
                self._busy.append(span)
                res = rollout_for_step(self.trainer, self.pool, s, self.drawn, samples=samples)
                span[1] = time.perf_counter()
                res.metrics["time/rollout_generated_ahead"] = span[1] - span[0]
                with self._cv:
                    self._ready[s] = res
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised in the training thread by step()
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def wait(self) -> dict[str, float]:
        """No wait at the sync point (the update goes into the running generation): the step's engine timeline."""
        now = time.perf_counter()
        start, self._window = self._window, now
        busy = sum(max(0.0, min(b if b is not None else now, now) - max(a, start)) for a, b in list(self._busy))
        self._busy = [x for x in self._busy if x[1] is None or x[1] > now]
        return {"perf/engine_busy_frac": min(1.0, busy / max(now - start, 1e-9))}

    def update(self, publisher, version: int) -> dict[str, float]:
        """The weight sync into running engines: pause in place, sync, continue. Every rank, in step."""
        engine = self.trainer.engine
        if self.trainer.cfg.engine.placement == "separate":
            # The engine ranks reach this point as soon as they took the batch; they pause only once the training
            # ranks have finished the update and are about to send (else the engines would sit paused through the
            # whole training step). Colocated, the ranks that pause are the ones that trained.
            dist.barrier()
        t0 = time.perf_counter()
        if engine is not None:
            engine.pause_in_place()
        try:
            out = publisher.publish(version)
        finally:
            if engine is not None:
                engine.continue_generation()
        pause = time.perf_counter() - t0
        with self._cv:
            self.version = version
            self._cv.notify_all()
        aborts = 0
        if engine is not None:  # requests the engine ended "abort" since the previous update (goal: none)
            total = engine.aborted_requests
            aborts, self._aborts_seen = total - self._aborts_seen, total
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, (pause if engine is not None else None, aborts))
        pauses = [p for p, _ in every if p is not None]
        out.update({"rollout/pause_s": max(pauses) if pauses else 0.0,
                    "rollout/aborted_per_update": float(sum(a for _, a in every))})
        return out
