"""The OpenAI front's work, without HTTP: requests -> our tokens -> `EngineClient.generate` -> choices + records.

Our side tokenizes (the HF chat template, token-in-token-out within a session through `mtrain.rollout.agents.tito`)
and parses tool calls (`mtrain.tools.parsers`), so the same code serves SGLang on GPU and the reference engine on
CPU: the engine only ever sees token ids. Stop strings are applied to the decoded output: the output is cut after
the token that completed the stop string (the recorded tokens end there, as SGLang's do) and the returned text
before it.

Each endpoint is `prepare_*` (checks and tokens: every request error is raised here, before any response starts) and
`run(job, on_delta)` (generation, then `Job.finish`: choices and records). With `on_delta` the engines stream each
choice's tokens as they are made (`client.stream`; the HTTP side is mtrain/serve/sse.py); the Result and what is
recorded are the same either way.
"""
from __future__ import annotations

import asyncio
import itertools
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

from mtrain.rollout.agents import tito
from mtrain.rollout.client import EngineClient, stream
from mtrain.rollout.protocol import Completion, Request, SamplingParams, TokenDelta
from mtrain.serve import sessions as S
from mtrain.serve.schemas import ChatRequest, CompletionRequest, FrontError
from mtrain.serve.streaming import ChoiceStream


DeltaSink = Callable[[int, TokenDelta], None]  # (choice index, its new tokens), called on the front's event loop


@dataclass
class Choice:
    index: int
    output_ids: list[int]  # the engine's ids, cut after a stop string
    logprobs: list[float]
    versions: list[int]
    text: str  # the returned text (stop string and stop token removed)
    finish_reason: str  # stop | length | tool_calls | abort
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    content: str | None = None  # chat: the message content (text before the tool calls)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per output token, when the request asked for them
    routed_experts: Any = None  # the engine's routing of prompt + output (routing replay), when it records it
    routed_start: int = 0  # the input position routed_experts' first row belongs to (the request's start)
    routed_version: int | None = None  # the weight version the routing was recorded under (the completion's)


@dataclass
class Result:
    prompt_ids: list[int]
    choices: list[Choice]
    branches: list[int]  # the session branch each choice was recorded as (empty without a session)


@dataclass
class Job:
    """A request checked and tokenized, not yet generated: errors in it surface before any response starts (a
    stream's HTTP status is sent with its first chunk). `finish` turns the completions into the Result (and records
    them), the same code with or without streaming."""
    prompt_ids: list[int]
    params: list[SamplingParams]
    session: S.Session | None
    stops: list[str]
    tool_marker: str | None  # where tool calls begin in the text (requests with tools)
    finish: Callable[[list[Completion]], Result]
    routed_start: int = 0  # routing replay: the first position whose routing the continued branch lacks


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())


class OpenAIFront:
    """model_name: what /v1/models lists and requests must name. max_positions: the model's context; a prompt
    plus its token budget beyond it is refused before generation. default_max_tokens: the budget when a request
    names none (capped by what the context leaves). tool_parser: "qwen25"/"hermes" (see mtrain.tools.parsers),
    needed for requests with tools."""

    def __init__(self, client: EngineClient, tokenizer, *, model_name: str, max_positions: int,
                 default_max_tokens: int = 256, tool_parser: str | None = None):
        self.client, self.tokenizer = client, tokenizer
        self.model_name, self.max_positions = model_name, int(max_positions)
        self.default_max_tokens = int(default_max_tokens)
        self.tool_parser = tool_parser
        self.stops = stop_token_ids(tokenizer)
        self.sessions = S.SessionStore()
        self._rid = itertools.count()

    # -- tokenizing -------------------------------------------------------------------------------------------
    def _render_prompt(self, messages, tools):
        try:
            return tito.prompt_ids(self.tokenizer, messages, tools)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault (e.g. a role it refuses)
            raise FrontError(400, f"the chat template cannot render these messages: {e}", param="messages") from e

    def _render_suffix(self, messages, tools, stop_text):
        try:
            return tito.suffix(self.tokenizer, messages, tools, stop_text=stop_text)
        except Exception as e:  # noqa: BLE001
            raise FrontError(400, f"the chat template cannot render the appended messages: {e}",
                             param="messages") from e

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise FrontError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                             param="model", code="model_not_found")

    def _params(self, req, prompt_len: int) -> list[SamplingParams]:
        room = self.max_positions - prompt_len
        if room < 1:
            raise FrontError(400, f"this model's maximum context length is {self.max_positions} tokens and the prompt "
                                  f"alone has {prompt_len}", param="messages", code="context_length_exceeded")
        budget = req.budget
        if budget is None:
            budget = min(self.default_max_tokens, room)
        if budget > room:
            raise FrontError(400, f"this model's maximum context length is {self.max_positions} tokens; the prompt "
                                  f"has {prompt_len} tokens and {budget} more were asked for", param="messages",
                             code="context_length_exceeded")
        seed0 = req.seed if req.seed is not None else secrets.randbelow(2 ** 31)
        return [SamplingParams(max_new_tokens=budget, temperature=float(req.temperature), top_p=float(req.top_p),
                               stop_token_ids=self.stops, seed=seed0 + j, top_logprobs=req.top_logprobs_wanted)
                for j in range(req.n)]

    async def _generate(self, prompt_ids: list[int], params: list[SamplingParams], session: S.Session | None,
                        on_delta: DeltaSink | None = None, routed_start: int = 0,
                        stops: list[str] | None = None) -> list[Completion]:
        """routed_start: routing replay, the first position whose routing the continued branch lacks. stops: the
        request's stop strings; a choice whose text completes one is aborted in the engine at once (the engine
        stops on token ids only, and `_cut` drops everything after the stop string anyway)."""
        call = next(self._rid)
        head = session.rid_prefix if session is not None and session.rid_prefix else "front-"
        requests = [Request(rid=f"{head}c{call}-{j}-", prompt_ids=list(prompt_ids), params=p,
                            routed_experts_start=routed_start) for j, p in enumerate(params)]
        if on_delta is None and not stops:
            return list(await asyncio.gather(*(self._one(r) for r in requests)))

        async def streamed(j: int, request: Request) -> Completion:
            watch = ChoiceStream(self.tokenizer, stops, self.stops) if stops else None
            async for item in stream(self.client, request):  # aborts the request if this task is cancelled
                if isinstance(item, Completion):
                    return item
                if on_delta is not None:
                    on_delta(j, item)
                if watch is not None and not watch.done:
                    watch.push(list(item.output_ids))
                    if watch.done:  # the stop string is complete: the tokens after it would only be cut
                        self.client.abort(request.rid)
            raise RuntimeError(f"request {request.rid!r}: the stream ended without a completion")

        return list(await asyncio.gather(*(streamed(j, r) for j, r in enumerate(requests))))

    async def _one(self, request: Request) -> Completion:
        """One engine call that a cancelled HTTP handler (client gone, server stopping) aborts in the engine instead
        of cancelling the engine's future under it (an engine thread must never find its future cancelled)."""
        task = asyncio.ensure_future(self.client.generate(request))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self.client.abort(request.rid)
            raise

    def _cut(self, c: Completion, stops: list[str]) -> tuple[list[int], str, str, str | None]:
        """(ids kept, text returned, finish_reason, stop token text) of a completion, stop strings applied."""
        ids = list(c.output_ids)
        stop_text = None
        ended = bool(ids) and c.finish_reason == "stop" and ids[-1] in self.stops
        body = ids[:-1] if ended else ids
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        if stops and any(s in text for s in stops):
            for k in range(1, len(body) + 1):  # the first token whose text completes a stop string
                t = self.tokenizer.decode(body[:k], skip_special_tokens=True)
                hit = min((t.find(s) for s in stops if s in t), default=-1)
                if hit >= 0:
                    return body[:k], t[:hit], "stop", None
        if ended:
            stop_text = self.tokenizer.decode([ids[-1]], skip_special_tokens=False)
        return ids, text, ("stop" if c.finish_reason == "stop" else c.finish_reason), stop_text

    # -- endpoints --------------------------------------------------------------------------------------------
    async def run(self, job: Job, on_delta: DeltaSink | None = None) -> Result:
        """Generate a prepared job; with `on_delta`, every choice's tokens are passed on as they arrive."""
        return job.finish(await self._generate(job.prompt_ids, job.params, job.session, on_delta, job.routed_start,
                                               job.stops))

    async def chat(self, req: ChatRequest, session: S.Session | None) -> Result:
        return await self.run(self.prepare_chat(req, session))

    async def complete(self, req: CompletionRequest, session: S.Session | None) -> Result:
        return await self.run(self.prepare_complete(req, session))

    def prepare_chat(self, req: ChatRequest, session: S.Session | None) -> Job:
        self._check_model(req.model)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if tools and req.tool_choice != "none" and self.tool_parser is None:
            raise FrontError(400, "this server was started without a tool-call parser (serve.tool_parser); "
                                  "requests with tools cannot be served", param="tools")
        template_tools = tools if req.tool_choice != "none" else None
        messages = [m.as_template_message() for m in req.messages]
        plan = S.plan_chat(session, messages, template_tools, self.tokenizer, self._render_prompt,
                           self._render_suffix)
        params = self._params(req, len(plan.prompt_ids))
        parser = None
        if template_tools:
            from mtrain.tools.parsers import ToolCallParser
            parser = ToolCallParser(self.tool_parser, template_tools)
        return Job(plan.prompt_ids, params, session, req.stop or [], parser.start_marker if parser else None,
                   lambda completions: self._chat_result(req, session, plan, messages, template_tools, parser,
                                                         completions),
                   plan.routed_experts_start(self.client.weight_version))

    def _chat_result(self, req, session, plan, messages, template_tools, parser, completions) -> Result:
        choices, branches = [], []
        for j, c in enumerate(completions):
            ids, text, finish, stop_text = self._cut(c, req.stop)
            ch = Choice(j, ids, c.logprobs[:len(ids)], c.versions[:len(ids)], text, finish, content=text,
                        top_logprobs=_cut(c.top_logprobs, len(ids)), routed_experts=c.routed_experts,
                        routed_start=c.routed_experts_start, routed_version=c.weight_version)
            if parser is not None:
                parsed = parser.parse(text)
                if parsed.calls:
                    ch.content = parsed.normal_text or None
                    ch.tool_calls = [{"id": f"call_{secrets.token_hex(8)}", "type": "function",
                                      "function": {"name": k.name, "arguments": k.arguments}} for k in parsed.calls]
                    ch.finish_reason = "tool_calls"
            choices.append(ch)
            if session is not None:
                reply = {"role": "assistant", "content": ch.content or ""}
                if ch.tool_calls:
                    reply["tool_calls"] = ch.tool_calls
                b = S.record(session, plan, messages, S.tools_key(template_tools), reply, ids, ch.logprobs,
                             ch.versions, text, stop_text, ch.finish_reason, routed=ch.routed_experts,
                             routed_start=ch.routed_start, routed_version=ch.routed_version)
                branches.append(b.id)
        if session is not None:
            session.calls += 1
        return Result(plan.prompt_ids, choices, branches)

    def prepare_complete(self, req: CompletionRequest, session: S.Session | None) -> Job:
        self._check_model(req.model)
        if isinstance(req.prompt, str):
            prompt = list(self.tokenizer.encode(req.prompt))
        else:
            prompt = list(req.prompt)
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                raise FrontError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        plan = S.plan_tokens(session, prompt) if not isinstance(req.prompt, str) else S.Plan(
            None, prompt, [], "", rerendered=bool(session is not None and session.branches))
        params = self._params(req, len(prompt))
        return Job(prompt, params, session, req.stop or [], None,
                   lambda completions: self._complete_result(req, session, plan, prompt, completions),
                   plan.routed_experts_start(self.client.weight_version))

    def _complete_result(self, req, session, plan, prompt, completions) -> Result:
        choices, branches = [], []
        for j, c in enumerate(completions):
            ids, text, finish, stop_text = self._cut(c, req.stop)
            choices.append(Choice(j, ids, c.logprobs[:len(ids)], c.versions[:len(ids)], text, finish,
                                  top_logprobs=_cut(c.top_logprobs, len(ids))))
            if session is not None:
                b = S.record(session, plan, [], "completions", {"role": "completion", "content": text}, ids,
                             c.logprobs[:len(ids)], c.versions[:len(ids)], text, stop_text, finish,
                             routed=c.routed_experts, routed_start=c.routed_experts_start,
                             routed_version=c.weight_version)
                branches.append(b.id)
        if session is not None:
            session.calls += 1
        return Result(prompt, choices, branches)


def _cut(top: list | None, n: int) -> list | None:
    return None if top is None else top[:n]
