"""Building the multi-turn rollout's parts from the run config (`multi_turn:` section, mtrain/config.py).

    tools = build_tool_server(cfg.multi_turn)                            # once per run
    ctx = make_context(cfg, tokenizer, tools, reward_fn, base_seed=..., rid_prefix=f"s{step}-g{i}")
    rollout = load_rollout_fn(cfg.multi_turn.rollout_fn)                 # e.g. multi_turn:rollout_group
    trajectories = await rollout(sample, n, client, ctx)

Tools are named in `multi_turn.tools`: the builtins "python", "search", "calculator", or "module:Name" for a
user tool (a BaseTool subclass, instantiated without arguments, or a function returning a BaseTool), resolved
the way reward functions are.
"""
from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any, Callable

from mtrain.data.rewards import load_object
from mtrain.rollout.agents.multi_turn import DEFAULT_SYSTEM_PROMPT, RolloutContext
from mtrain.rollout.protocol import SamplingParams
from mtrain.tools.base import BaseTool
from mtrain.tools.parsers import ToolCallParser
from mtrain.tools.server import ToolServer

BUILTIN_TOOLS = ("python", "search", "calculator")


class AgentConfigError(ValueError):
    """A multi_turn setting that cannot be built; the message names the key."""


def build_tool(spec: str, mt) -> BaseTool:
    if spec == "calculator":
        from mtrain.tools.calculator import CalculatorTool
        return CalculatorTool()
    if spec == "python":
        from mtrain.tools.python_tool import PythonTool
        from mtrain.tools.sandbox import SandboxLimits
        return PythonTool(SandboxLimits(wall_s=mt.sandbox_wall_s, cpu_s=mt.sandbox_cpu_s,
                                        memory_mb=mt.sandbox_memory_mb, max_procs=mt.sandbox_max_procs,
                                        max_output_chars=mt.tool_output_max_chars, max_disk_mb=mt.sandbox_disk_mb,
                                        max_files=mt.sandbox_max_files, network=mt.sandbox_network))
    if spec == "search":
        from mtrain.tools.retrieval import RetrievalTool, load_corpus
        docs = load_corpus(mt.retrieval_corpus) if mt.retrieval_corpus else None
        return RetrievalTool(docs, top_k=mt.retrieval_top_k)
    if ":" not in spec:
        raise AgentConfigError(f"multi_turn.tools: {spec!r} is not a builtin tool {BUILTIN_TOOLS} "
                               f"nor 'module:Name'")
    obj = load_object(spec, what="tool", error=AgentConfigError)
    tool = obj() if inspect.isclass(obj) or callable(obj) else obj
    if not isinstance(tool, BaseTool):
        raise AgentConfigError(f"multi_turn.tools: {spec!r} gave a {type(tool).__name__}, not a BaseTool")
    return tool


def build_tool_server(mt) -> ToolServer:
    return ToolServer([build_tool(s, mt) for s in mt.tools], timeout_s=mt.tool_timeout_s,
                      max_output_chars=mt.tool_output_max_chars)


def load_rollout_fn(spec: str | None) -> Callable[..., Any]:
    """The per-group rollout function named by multi_turn.rollout_fn: async (sample, n, client, ctx) -> list."""
    if spec is None:
        raise AgentConfigError("multi_turn.rollout_fn is not set")
    fn = load_object(spec, what="rollout function", error=AgentConfigError)
    if not inspect.iscoroutinefunction(fn):
        raise AgentConfigError(f"multi_turn.rollout_fn {spec!r} must be an async function "
                               f"(sample, n, client, ctx) -> list[Trajectory]")
    try:
        inspect.signature(fn).bind("sample", 1, "client", "ctx")
    except TypeError as e:
        raise AgentConfigError(f"multi_turn.rollout_fn {spec!r} must accept (sample, n, client, ctx): {e}") from None
    return fn


def make_context(cfg, tokenizer, tools: ToolServer, reward_fn, *, base_seed: int, rid_prefix: str,
                 params: SamplingParams, greedy: bool = False, max_positions: int | None = None) -> RolloutContext:
    """cfg: the RunConfig. params: the per-turn sampling params the single-turn rollout builds (stop ids
    included); greedy for evaluation; max_positions: the model's max_position_embeddings."""
    mt = cfg.multi_turn
    if greedy:
        params = replace(params, temperature=0.0, top_p=1.0, top_k=-1)
    parser = ToolCallParser(mt.tool_parser, tools.schemas, backend=mt.parser_backend)
    return RolloutContext(tokenizer=tokenizer, tools=tools, parser=parser, params=params, reward_fn=reward_fn,
                          base_seed=base_seed, rid_prefix=rid_prefix, max_turns=mt.max_turns,
                          max_total_tokens=mt.max_total_tokens, max_tool_calls_per_turn=mt.max_tool_calls_per_turn,
                          tool_reward_weight=mt.tool_reward_weight,
                          system_prompt=mt.system_prompt if mt.system_prompt is not None else DEFAULT_SYSTEM_PROMPT,
                          reward_timeout_s=cfg.reward.timeout_s, max_positions=max_positions)
