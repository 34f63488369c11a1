"""The rollout engine protocol: what the trainer asks of any engine (SGLang on GPU, the CPU reference).

The trainer only ever talks to `RolloutEngine`. Token ids go in, token ids and per-token logprobs come out,
and new weights arrive bucket by bucket in the engine's *own* parameter names and per-rank shapes (the
resharding planner produces them for the engine's `layout`). Keeping the contract this small is what lets
CI run the whole RL loop on CPU with the reference engine and the GPU run it with SGLang unchanged.
"""
from __future__ import annotations

import abc
import concurrent.futures
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal

import torch

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache")
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs: the front's requests (mtrain/serve/schemas.py)
# the engines' own: score centering (algo.score_centering_k, docs/design-score-centering.md) asks for up to this many
MAX_ENGINE_TOP_LOGPROBS = 1024


class EngineError(RuntimeError):
    """An engine died or refused an operation; the message says which request/tensor/setting and why.

    One exception type so the trainer can catch engine failures without knowing which engine it runs.
    """


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Frozen: one instance is shared by all n samples of a prompt.

    max_new_tokens: upper bound on generated tokens; reaching it finishes with "length".
    temperature: 0 means greedy (argmax); otherwise logits are divided by it before softmax.
    top_p: nucleus sampling, 1.0 disables it. top_k: keep the k most likely tokens, -1 disables it.
    stop_token_ids: generation stops after emitting one of these (the stop token is part of the output,
        finish "stop"). Put the model's EOS ids here: the reference engine stops on these ids only, while
        SGLang also stops on the config's / generation_config's eos_token_id; with EOS listed, both agree.
    seed: seeds this request's own sampler so results do not depend on batching; None = engine's choice.
    top_logprobs: per output token, also return the this-many most likely tokens with their logprobs (same
        distribution as `Completion.logprobs`; 0..MAX_ENGINE_TOP_LOGPROBS, the front allows 20). 0 = none.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        # Accept a list for convenience but store a tuple, so the frozen instance stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"SamplingParams.top_k must be -1 (disabled) or an int >= 1, got {self.top_k!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"SamplingParams.stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"SamplingParams.seed must be None or an int >= 0, got {self.seed!r}")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) or not (
                0 <= self.top_logprobs <= MAX_ENGINE_TOP_LOGPROBS):
            raise ValueError(f"SamplingParams.top_logprobs must be an int in [0, {MAX_ENGINE_TOP_LOGPROBS}], "
                             f"got {self.top_logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenDelta:
    """Tokens one request generated since its previous delta (streaming, `Request.on_tokens`): ids, their logprobs
    and, when the request asked for them, their top logprobs (same meaning as in `Completion`)."""

    output_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None


# The streaming hook's contract (the one place it is declared):
# - an engine calls `request.on_tokens(delta)` from any thread (its own decode thread / event loop), in order, as soon
#   as it has new tokens of that request (the reference engine after every decoding step, SGLang per stream chunk);
# - before the request's future resolves, the deltas concatenate to exactly the Completion's output_ids, logprobs and
#   top_logprobs (an abort included); the Completion stays the record: streaming never changes what it holds;
# - the hook must be quick and must not block; one that raises is logged and not called again for that request (its
#   deltas then stop short of the Completion), the generation itself goes on. Whatever sits between a caller and an engine passes the Request, hook included.
TokenHook = Callable[[TokenDelta], None]


def emit_tokens(request: "Request", delta: TokenDelta) -> None:
    """Call the request's hook (engines use this); a failing hook is logged and dropped, never fails the batch."""
    hook = request.on_tokens
    if hook is None or not delta.output_ids:
        return
    try:
        hook(delta)
    except Exception:  # noqa: BLE001 - the consumer's bug (or its loop is gone); the generation is unaffected
        log.warning("request %r: its on_tokens hook raised; no more deltas for it", request.rid, exc_info=True)
        request.on_tokens = None


@dataclass
class Request:
    """One sequence to generate. `rid` must be unique among in-flight requests (abort matches by prefix)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # Images of the prompt (mtrain.data.vision.VisionInputs): pixel values and patch grids computed once by the
    # processor; prompt_ids already hold each image's expanded image tokens. None: a text-only request.
    vision: Any = None
    # Routing replay: return routed experts only from this input position on (SGLang's routed_experts_start_len):
    # a caller that already holds the rows of prompt_ids[:start] (an earlier turn, an aborted request it resumes)
    # asks for the rest only. 0 <= start <= len(prompt_ids); 0 = every row. Ignored by engines that record none.
    routed_experts_start: int = 0
    # Streaming: called with each TokenDelta as tokens are generated (contract above `TokenHook`). None: no streaming.
    on_tokens: TokenHook | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        bad = routed_start_error(self)
        if bad:
            raise ValueError(bad)


def routed_start_error(req: "Request") -> str | None:
    """Why `req.routed_experts_start` is unusable, or None. Engines re-check it (a request may be changed after it
    was built) and raise EngineError with the same message."""
    start = req.routed_experts_start
    if isinstance(start, bool) or not isinstance(start, int):
        return f"request {req.rid!r}: routed_experts_start must be an int, got {start!r}"
    n = len(req.prompt_ids) if req.prompt_ids is not None else 0
    if not 0 <= start <= n:
        return (f"request {req.rid!r}: routed_experts_start {start} is outside [0, {n}] (the prompt's "
                f"{n} tokens): rows can be asked from any prompt position, no further")
    return None


# The least host memory one Completion takes: the object, its three lists, rid and a logprob (311 bytes measured with
# one prompt and one output token, its field dict not counted: that one's size depends on how Python laid the
# instance out; tests/test_preflight_batch.py checks the floor stays below the count). Every rank holds every
# completion of a step, so a step's samples x this is a floor under its host memory (mtrain/preflight.py).
MIN_COMPLETION_HOST_BYTES = 256


@dataclass
class Completion:
    """The result of one Request.

    logprobs[i] is the log-probability of output_ids[i] under log_softmax(logits / temperature), taken
    *before* top-k/top-p filtering (temperature 0: log_softmax(logits)). That is the distribution the trainer
    recomputes, so the two can be compared token by token (and importance ratios formed).
    weight_version: the engine's weight_version when the request ran, so stale rollouts can be detected.
    """

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int
    # Per output token, the weight version that produced it; None = all weight_version. A sample resumed across a
    # weight sync (partial rollout) spans several versions.
    token_versions: list[int] | None = None
    # Per output token, the request's `top_logprobs` most likely (token id, logprob) pairs, most likely first; None
    # when the request asked for none.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    vision: Any = None  # the request's VisionInputs, passed through so the trainer's batch keeps the images
    # Routing replay (mtrain/rollout/routing.py): [prompt + output - 1 - routed_experts_start, layers, top_k] logical
    # expert ids of the input tokens from position routed_experts_start on (row i = token start + i), when the engine
    # records them; None otherwise.
    routed_experts: torch.Tensor | None = None
    routed_experts_start: int = 0  # the request's: the input position routed_experts' first row belongs to
    # Rows the engine(s) sent for this sample over all its requests (a partial-rollout sample resumed after aborts);
    # None: those of routed_experts. Only the `routing/engine_bytes_*` metrics read it.
    routed_rows_received: int | None = None

    @property
    def versions(self) -> list[int]:
        return list(self.token_versions) if self.token_versions is not None else [self.weight_version] * len(
            self.output_ids)

    def __post_init__(self) -> None:
        if self.token_versions is not None and len(self.token_versions) != len(self.output_ids):
            raise ValueError(f"Completion {self.rid!r}: {len(self.output_ids)} output ids but "
                             f"{len(self.token_versions)} token versions")
        if self.top_logprobs is not None and len(self.top_logprobs) != len(self.output_ids):
            raise ValueError(f"Completion {self.rid!r}: {len(self.output_ids)} output ids but "
                             f"{len(self.top_logprobs)} top-logprob lists")
        start = self.routed_experts_start
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(self.prompt_ids):
            raise ValueError(f"Completion {self.rid!r}: routed_experts_start {start!r} is outside "
                             f"[0, {len(self.prompt_ids)}]")
        if self.routed_experts is not None:
            from mtrain.rollout.routing import routed_rows
            want = routed_rows(len(self.prompt_ids), len(self.output_ids), start)
            if self.routed_experts.shape[0] != want:
                raise ValueError(f"Completion {self.rid!r}: routed experts cover {self.routed_experts.shape[0]} "
                                 f"tokens, expected prompt + output - 1 - start = {want} (start {start})")
        if len(self.output_ids) != len(self.logprobs):
            raise ValueError(
                f"Completion {self.rid!r}: {len(self.output_ids)} output ids but {len(self.logprobs)} logprobs"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Completion {self.rid!r}: finish_reason must be one of {FINISH_REASONS}, "
                             f"got {self.finish_reason!r}")


class RolloutEngine(abc.ABC):
    """An inference engine the trainer drives: generate, receive weights, give memory back.

    layout: the destination layout the resharding planner targets ("hf" for the reference engine, "sglang");
    tp_size: how many engine TP ranks `update_weights` receives tensors for.
    """

    layout: str
    tp_size: int

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version passed to the last finish_weight_update (0 before any); stamped on every Completion."""

    @abc.abstractmethod
    def generate(self, requests: list[Request]) -> list[Completion]:
        """Generate every request; returns completions in the same order as `requests`."""

    @abc.abstractmethod
    def submit(self, request: Request) -> concurrent.futures.Future:
        """Queue one request and return at once: a future of its Completion. Thread-safe, callable from any
        thread or event loop (`mtrain.rollout.client.LocalClient` awaits it); concurrent requests are batched by
        the engine. A request the engine refuses fails its own future only."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Hold new and queued requests until resume(); running ones go on (abort them to stop them)."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Let held requests run again."""

    def pause_in_place(self) -> None:
        """Stop generating between two decoding steps, keeping every running request and its KV cache (SGLang's
        pause_generation(mode="in_place")). Returns once nothing decodes. While paused a weight sync may run (its
        finish keeps the KV of the paused requests); continue_generation() then goes on with the same requests,
        whose further tokens carry the new weight_version (Completion.token_versions)."""
        raise EngineError(f"{type(self).__name__} cannot pause in place")

    def continue_generation(self) -> None:
        """End pause_in_place: the paused requests decode on, under whatever weights the engine now holds."""
        raise EngineError(f"{type(self).__name__} cannot pause in place")

    @property
    def aborted_requests(self) -> int:
        """How many requests this engine has ended with finish_reason "abort" since it started (any cause)."""
        raise EngineError(f"{type(self).__name__} does not count aborted requests")

    @abc.abstractmethod
    def update_weights(self, rank_tensors: list[list[tuple[str, torch.Tensor]]]) -> None:
        """Write one bucket of a weight sync.

        rank_tensors[r] holds (name, tensor) pairs for engine TP rank r, in the engine's OWN parameter names
        and per-rank shapes (the planner already sliced them), so the engine copies without re-slicing.
        Called once per bucket; `finish_weight_update` closes the sync.
        """

    @abc.abstractmethod
    def finish_weight_update(self, version: int) -> None:
        """Called after the last bucket: the new weights are complete; bumps weight_version to `version`."""

    def pull_weights(self, jobs: list, version: int | None = None) -> None:
        """Pull mode (`mtrain.reshard.pull`): jobs[r] (a PullJob, or None) tells engine rank r which trainer
        tensors to read and how to write its parameters from them; the engine writes them itself. With
        `version` the call also closes the sync, as finish_weight_update does."""
        raise EngineError(f"{type(self).__name__} does not support pull mode; use sync.mode=push")

    @abc.abstractmethod
    def release_memory(self, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        """Free the memory of `tags` ("weights", "kv_cache") so training can use it (colocated mode)."""

    @abc.abstractmethod
    def resume_memory(self, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        """Re-allocate released memory. Resumed weights are garbage until a full weight sync is pushed."""

    @abc.abstractmethod
    def abort(self, rid_prefix: str | None = None) -> None:
        """Finish in-flight requests whose rid starts with `rid_prefix` (all when None) with "abort";
        their generate() returns the partial output."""

    @abc.abstractmethod
    def flush_cache(self) -> None:
        """Drop cached prefixes (KV computed with old weights must not be reused after a sync)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and free everything it holds; the engine is unusable afterwards."""


def expand_samples(
    prompts: list[list[int]], n: int, params: SamplingParams, base_seed: int, rid_prefix: str
) -> list[Request]:
    """n requests per prompt (a GRPO group), prompt-major: prompt 0's n samples, then prompt 1's, ...

    Every request gets a DISTINCT seed (base_seed + its index): with one shared seed a group's n samples
    would be identical and its advantages all zero. Seeds span [base_seed, base_seed + len(prompts) * n), so
    callers advance base_seed by at least that much between calls (e.g. step * 10**9) to keep steps apart. rids are f"{rid_prefix}-{i:0Wd}-{j:0Wd}-" with fixed
    widths and a closing dash, so no rid is a prefix of another (SGLang aborts by prefix: "a1" would
    abort "a10"), and abort(rid_prefix) aborts the whole batch while abort(f"{rid_prefix}-{i:0Wd}-") one group.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"expand_samples: n must be an int >= 1, got {n!r}")
    if isinstance(base_seed, bool) or not isinstance(base_seed, int) or base_seed < 0:
        raise ValueError(f"expand_samples: base_seed must be an int >= 0, got {base_seed!r}")
    if not isinstance(rid_prefix, str) or not rid_prefix:
        raise ValueError(f"expand_samples: rid_prefix must be a non-empty string, got {rid_prefix!r}")
    pw = len(str(max(len(prompts) - 1, 0)))
    sw = len(str(n - 1))
    requests = []
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"expand_samples: prompt {i} is empty")
        for j in range(n):
            seed = base_seed + i * n + j
            requests.append(Request(
                rid=f"{rid_prefix}-{i:0{pw}d}-{j:0{sw}d}-",
                prompt_ids=list(prompt),
                params=replace(params, seed=seed),
            ))
    return requests
