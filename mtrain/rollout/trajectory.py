"""A trajectory is token segments; the trainer's batch is built from them without re-tokenizing anything.

    prompt  [mask 0]  the rendered prompt's ids
    model   [mask 1]  a model turn: the engine's output ids exactly as generated, their logprobs and the weight
                      version each token was sampled under (a turn resumed after an abort may span two versions)
    env     [mask 0]  what the environment appends: the tool results rendered by the chat template, the template's
                      glue between turns and the next generation prompt

`to_batch` turns trajectories into the same `RolloutBatch` tensors `build_batch` makes for single-turn
completions (tokens, response_mask, engine_logprobs, rewards, response_lens), so the trainer trains on them
unchanged: response_mask[b, t] is 1 exactly when token t + 1 is a model token, whatever turn it belongs to.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mtrain.rollout.rollout_batch import RolloutBatch, vision_rows

SegmentKind = Literal["prompt", "model", "env"]


@dataclass
class Segment:
    kind: SegmentKind
    ids: list[int]
    logprobs: list[float] | None = None  # model segments only
    versions: list[int] | None = None  # model segments only: weight version per token
    text: str = ""  # model: the decoded turn; env: the rendered text the ids encode
    # model segments, score centering: per token the engine's top-k (token id, logprob) pairs; None when not asked
    top_logprobs: list | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("prompt", "model", "env"):
            raise ValueError(f"Segment.kind must be prompt, model or env, got {self.kind!r}")
        if self.kind == "model":
            if self.logprobs is None or self.versions is None:
                raise ValueError("a model segment needs logprobs and versions per token")
            if not len(self.ids) == len(self.logprobs) == len(self.versions):
                raise ValueError(f"model segment: {len(self.ids)} ids, {len(self.logprobs)} logprobs, "
                                 f"{len(self.versions)} versions")
            if self.top_logprobs is not None and len(self.top_logprobs) != len(self.ids):
                raise ValueError(f"model segment: {len(self.ids)} ids, {len(self.top_logprobs)} top-logprob lists")
        elif self.logprobs is not None or self.versions is not None or self.top_logprobs is not None:
            raise ValueError(f"a {self.kind} segment carries no logprobs or versions (it is not trained)")

    @property
    def trained(self) -> bool:
        return self.kind == "model"


@dataclass
class Trajectory:
    """One sample of a group. `finish_reason`: stop (the model answered without a tool call), length (a turn hit
    max_new_tokens), max_turns, budget (the token budget ran out), abort (aborted mid-turn: resumable), image_token (a
    vision model's image token after the prompt, sampled or in a tool's text: engines would take it for an image slot,
    so it is never fed back). `vision`: the prompt's images; every turn's request carries them, `to_batch` too."""

    rid: str
    segments: list[Segment]
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation as chat messages
    finish_reason: str | None = None
    reward: float | None = None
    turns: int = 0  # model turns completed
    metrics: dict[str, float] = field(default_factory=dict)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # the session's call log
    sample: Any = None  # the PromptSample
    vision: Any = None  # the prompt's images (mtrain.data.vision.VisionInputs); the prompt segment holds their tokens
    # Routing replay: [rows, L, k] the engine's routed experts of tokens[:rows] (rows <= len(tokens) - 1), each row as
    # recorded by the request that first fed or produced that token under the current rows' weights
    # (`record_routing`); None when not recorded.
    routed_experts: Any = None
    routing_rows_received: int = 0  # rows the engine sent over all of this trajectory's requests (traffic metric)
    # the weight version every held row was routed under; None when unknown or mixed (the next request re-asks all)
    routing_version: int | None = None

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.segments for t in s.ids]

    @property
    def loss_mask(self) -> list[int]:
        return [int(s.trained) for s in self.segments for _ in s.ids]

    @property
    def prompt_len(self) -> int:
        return len(self.segments[0].ids) if self.segments and self.segments[0].kind == "prompt" else 0

    @property
    def model_ids(self) -> list[int]:
        return [t for s in self.segments if s.trained for t in s.ids]

    @property
    def num_model_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments if s.trained)

    @property
    def final_text(self) -> str:
        """The last model turn's text (what single-turn reward functions score)."""
        for s in reversed(self.segments):
            if s.trained:
                return s.text
        return ""

    def add_model_tokens(self, ids: list[int], logprobs: list[float], version: int | list[int], text: str = "", *,
                         continue_last: bool = False, top_logprobs: list | None = None) -> None:
        """Append generated tokens as a new model turn, or (continue_last: a turn resumed after an abort) extend
        the last model segment; each token keeps the weight version it was sampled under (`version`: one for all,
        or one per token, `Completion.versions`: an update in place may land inside a turn)."""
        versions = list(version) if isinstance(version, list) else [version] * len(ids)
        if len(versions) != len(ids):
            raise ValueError(f"trajectory {self.rid}: {len(ids)} model tokens with {len(versions)} versions")
        if continue_last:
            if not self.segments or self.segments[-1].kind != "model":
                raise ValueError(f"trajectory {self.rid}: nothing to continue (the last segment is not a model turn)")
            s = self.segments[-1]
            s.ids += ids
            s.logprobs += logprobs
            s.versions += versions
            s.text += text
            if top_logprobs is not None or s.top_logprobs is not None:  # a side without a head: empty lists
                s.top_logprobs = (s.top_logprobs or [[]] * (len(s.ids) - len(ids))) + list(top_logprobs or [[]] * len(ids))
        else:
            self.segments.append(Segment("model", list(ids), list(logprobs), versions, text,
                                         None if top_logprobs is None else list(top_logprobs)))

    @property
    def routing_start(self) -> int:
        """The first position whose routing this trajectory lacks: the next request's `routed_experts_start`."""
        from mtrain.rollout.routing import held_rows
        return held_rows(self.routed_experts)

    def routing_request_start(self, version: int) -> int:
        """The next request's `routed_experts_start` when new requests run on weight `version`: the first position
        whose routing this trajectory lacks, or 0 (every row) when the held rows were routed under other weights.
        That request feeds the whole trajectory under `version` and samples its tokens from that forward, so its
        rows replace the held ones (the trainer replays one routing per token: the one the newest tokens saw)."""
        return self.routing_start if self.routing_version is not None and version == self.routing_version else 0

    def record_routing(self, comp_routing, start: int = 0, version: int | None = None) -> None:
        """Keep the routing a completion brought: rows of the trajectory's tokens from position `start` (the
        completion's `routed_experts_start`) to the last token minus one, routed under weight `version` (the
        completion's). A request that asked from 0 brought every row: they replace the held ones (a first request,
        a turn resumed after an abort, or a call on new weights: `routing_request_start`). One that asked from later
        extends the held rows at their own positions; if it ran on other weights than they were routed under (the
        weights changed between building the request and running it), the result mixes two versions and
        `routing_version` becomes None, so that the next request re-asks every row."""
        if comp_routing is None:
            return
        from mtrain.rollout.routing import merge_resumed
        self.routed_experts = merge_resumed(None if start == 0 else self.routed_experts, comp_routing,
                                            len(self.tokens) - 1, start)
        self.routing_rows_received += int(comp_routing.shape[0])
        same = start == 0 or (self.routing_version is not None and version == self.routing_version)
        self.routing_version = version if same else None

    def check(self) -> None:
        """Raise when the trajectory cannot be trained on (no prompt first, two env segments merged wrongly...)."""
        if not self.segments or self.segments[0].kind != "prompt" or not self.segments[0].ids:
            raise ValueError(f"trajectory {self.rid}: must start with a non-empty prompt segment")
        if any(s.kind == "prompt" for s in self.segments[1:]):
            raise ValueError(f"trajectory {self.rid}: more than one prompt segment")


def to_batch(trajectories: list[Trajectory], pad_id: int, pad_to_multiple: int = 1,
             rewards: list[float] | None = None, routing=None) -> RolloutBatch:
    """The trainer's padded batch. rewards: one per trajectory (default: each trajectory's `reward`).
    response_lens counts the tokens after the prompt (model and environment). routing: the model's `RoutingShape`
    when the run replays the engine's routing (every trajectory with model tokens must have recorded it)."""
    if not trajectories:
        raise ValueError("to_batch: no trajectories")
    if rewards is None:
        missing = [t.rid for t in trajectories if t.reward is None]
        if missing:
            raise ValueError(f"to_batch: trajectories without a reward: {missing[:4]}")
        rewards = [float(t.reward) for t in trajectories]
    if len(rewards) != len(trajectories):
        raise ValueError(f"to_batch: {len(trajectories)} trajectories but {len(rewards)} rewards")
    for t in trajectories:
        t.check()
    lengths = [sum(len(s.ids) for s in t.segments) for t in trajectories]
    width = -(-max(lengths) // pad_to_multiple) * pad_to_multiple
    b = len(trajectories)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width - 1))
    engine_lp = torch.zeros((b, width - 1))
    versions = torch.full((b, width - 1), -1, dtype=torch.long)
    for i, t in enumerate(trajectories):
        pos = 0
        for s in t.segments:
            n = len(s.ids)
            if n:
                tokens[i, pos:pos + n] = torch.tensor(s.ids, dtype=torch.long)
                if s.trained:  # position p predicts token p + 1: token at pos is predicted from pos - 1
                    mask[i, pos - 1:pos - 1 + n] = 1.0
                    engine_lp[i, pos - 1:pos - 1 + n] = torch.tensor(s.logprobs, dtype=torch.float32)
                    versions[i, pos - 1:pos - 1 + n] = torch.tensor(s.versions, dtype=torch.long)
            pos += n
    routed = None if routing is None else _batch_routing(trajectories, lengths, width, routing)
    head_ids, head_lp = _batch_heads(trajectories, width)
    return RolloutBatch(tokens, mask, engine_lp, torch.tensor(rewards, dtype=torch.float32),
                        torch.tensor([n - t.prompt_len for n, t in zip(lengths, trajectories)]),
                        torch.tensor(lengths), versions, vision_rows([t.vision for t in trajectories]), routed,
                        engine_head_ids=head_ids, engine_head_logprobs=head_lp)


def _batch_heads(trajectories: list[Trajectory], width: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Score centering: [B, width - 1, K] the engine's top-k token ids and logprobs at each predicting position of a
    model token (K: the longest list; absent entries: id 0, logprob -inf); (None, None) when no segment has any."""
    k = max((len(row) for t in trajectories for s in t.segments if s.top_logprobs for row in s.top_logprobs), default=0)
    if k == 0:
        return None, None
    ids = torch.zeros((len(trajectories), width - 1, k), dtype=torch.long)
    lps = torch.full((len(trajectories), width - 1, k), float("-inf"))
    for i, t in enumerate(trajectories):
        pos = 0
        for s in t.segments:
            if s.top_logprobs is not None:
                for j, row in enumerate(s.top_logprobs):  # token pos + j is predicted from position pos + j - 1
                    if row:
                        ids[i, pos + j - 1, :len(row)] = torch.tensor([int(r[0]) for r in row])
                        lps[i, pos + j - 1, :len(row)] = torch.tensor([float(r[1]) for r in row])
            pos += len(s.ids)
    return ids, lps


def _batch_routing(trajectories: list[Trajectory], lengths: list[int], width: int, shape) -> torch.Tensor:
    """[B, width, L, k]. Environment tokens after a trajectory's last model turn (max_turns reached after a tool
    call, the budget spent) were never fed to the engine: their rows hold the filler. They influence no trained
    token (causal attention), but the disagreement metric counts them."""
    from mtrain.rollout.routing import batch_routing
    samples = []
    for t, n in zip(trajectories, lengths):
        r = t.routed_experts
        unfed = _unfed_tail(t)
        if r is not None and unfed and r.shape[0] == n - 1 - unfed:  # any other row count fails batch_routing's check
            r = torch.cat([r, shape.filler().to(r.dtype).expand(unfed, shape.num_layers, shape.top_k)])
        samples.append((t.rid, n, r, t.num_model_tokens > 0))
    return batch_routing(shape, width, samples)


def _unfed_tail(t: Trajectory) -> int:
    """Tokens after the trajectory's last model turn (tool results never fed to the engine); 0 without model turns."""
    tail = 0
    for s in reversed(t.segments):
        if s.trained:
            return tail
        tail += len(s.ids)
    return 0
