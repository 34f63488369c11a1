"""The multi_turn config section builds the tools, the parser and the rollout context; bad names fail early."""
import asyncio

import pytest

from mtrain.config import ConfigError, load_config
from mtrain.data import CharTokenizer
from mtrain.rollout.agents.multi_turn import rollout_group
from mtrain.rollout.agents.setup import AgentConfigError, build_tool_server, load_rollout_fn, make_context
from mtrain.rollout.protocol import SamplingParams

BASE = ["model.hf_path=x", "data.task=arithmetic"]


def test_config_builds_tools_and_context(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("Glitrux has a population of 39888.\nQuelmar exports salt.\n")
    cfg = load_config(None, BASE + ["multi_turn.tools=python,search,calculator", f"multi_turn.retrieval_corpus={corpus}",
                                    "multi_turn.max_turns=3", "multi_turn.sandbox_memory_mb=128",
                                    "multi_turn.rollout_fn=mtrain.rollout.agents.multi_turn:rollout_group"])
    server = build_tool_server(cfg.multi_turn)
    assert sorted(server.tools) == ["calculator", "python", "search"]
    assert server.tools["python"].limits.memory_mb == 128
    assert server.tools["search"].documents[0].startswith("Glitrux")
    tok = CharTokenizer()
    ctx = make_context(cfg, tok, server, None, base_seed=5, rid_prefix="s0-g1",
                       params=SamplingParams(stop_token_ids=(tok.eos_token_id,)), greedy=True, max_positions=300)
    assert ctx.max_turns == 3 and ctx.params.temperature == 0 and ctx.token_budget == 300
    assert "{tools}" in ctx.system_prompt and ctx.parser.name == "qwen25"
    assert load_rollout_fn(cfg.multi_turn.rollout_fn) is rollout_group


def test_user_tools_and_rollout_functions_by_module_path(tmp_path):
    mod = tmp_path / "my_tools.py"
    mod.write_text("from mtrain.tools.base import BaseTool\n"
                   "class Echo(BaseTool):\n"
                   "    schema = {'type': 'function', 'function': {'name': 'echo', 'parameters': {'type': 'object', "
                   "'properties': {'text': {'type': 'string'}}}}}\n"
                   "    def call(self, session, args):\n        return args.get('text', '')\n"
                   "def not_a_tool():\n    return 3\n"
                   "def sync_rollout(sample, n, client, ctx):\n    return []\n"
                   "async def rollout(sample, n, client, ctx):\n    return []\n")
    cfg = load_config(None, BASE + [f"multi_turn.tools={mod}:Echo"])
    server = build_tool_server(cfg.multi_turn)

    async def call():
        async with server.session("a") as s:
            return await server.call(s, "echo", {"text": "hi"})
    assert asyncio.run(call()).content == "hi"
    with pytest.raises(AgentConfigError, match="not a BaseTool"):
        build_tool_server(load_config(None, BASE + [f"multi_turn.tools={mod}:not_a_tool"]).multi_turn)
    with pytest.raises(AgentConfigError, match="not a builtin tool"):
        build_tool_server(load_config(None, BASE + ["multi_turn.tools=calculater"]).multi_turn)
    with pytest.raises(AgentConfigError, match="must be an async function"):
        load_rollout_fn(f"{mod}:sync_rollout")
    assert load_rollout_fn(f"{mod}:rollout").__name__ == "rollout"


def test_bad_values_are_refused_at_load():
    with pytest.raises(ConfigError, match="multi_turn.max_turns"):
        load_config(None, BASE + ["multi_turn.max_turns=0"])
    with pytest.raises(ConfigError, match="multi_turn.tool_parser"):
        load_config(None, BASE + ["multi_turn.tool_parser=llama4"])
    with pytest.raises(ConfigError, match="multi_turn.rollout_fn"):
        load_config(None, BASE + ["multi_turn.rollout_fn=nocolon"])


def test_a_prompt_over_the_token_budget_is_a_prompt_error(tmp_path):
    """The tools' system prompt rendered with a prompt reaches the model's context: one PromptError line (exit 2)
    naming what to change, not a ValueError traceback on every rank (a 256-position model with the calculator)."""
    from mtrain.data.chat import PromptError
    from mtrain.data.records import PromptSample
    from mtrain.rollout.agents.multi_turn import new_trajectory

    cfg = load_config(None, BASE + ["multi_turn.tools=calculator",
                                    "multi_turn.rollout_fn=mtrain.rollout.agents.multi_turn:rollout_group"])
    tok = CharTokenizer()
    ctx = make_context(cfg, tok, build_tool_server(cfg.multi_turn), None, base_seed=0, rid_prefix="s0-g0",
                       params=SamplingParams(stop_token_ids=(tok.eos_token_id,)), greedy=True, max_positions=256)
    with pytest.raises(PromptError, match=r"sample 7: the prompt has \d+ tokens .*model context 256"):
        new_trajectory(PromptSample(index=7, prompt="What is 3 + 4?", answer="7"), ctx, "r0")
