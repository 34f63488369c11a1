"""An example agent written only against the official `openai` client: a calculator tool loop.

It is what an agent someone already has looks like: it knows a base URL, a key and a model name, calls
`chat.completions.create` with `tools`, runs the tool calls it gets back locally, appends the results as `tool`
messages and asks again, until the model answers without a tool call (or `max_turns`). Nothing in it knows about
tokens: the front records them (`mtrain.serve`), and `agent_group_fn` makes it a rollout function for the pool.
Reward: 1.0 when the final answer is exactly the sample's answer, else 0.0.
"""
from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI

from mtrain.tools.calculator import CalculatorTool, evaluate, format_number

TOOLS = [CalculatorTool.schema]


def run_tool(name: str, arguments: str) -> str:
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        return format_number(evaluate(json.loads(arguments)["expression"]))
    except Exception as e:  # noqa: BLE001 - the model sees the error and may try again
        return f"error: {e}"


def make_calculator_agent(model: str, *, max_turns: int = 4, max_tokens: int = 64, temperature: float = 1.0,
                          system_prompt: str | None = None):
    """The agent as `async (base_url, api_key, sample) -> reward`; sample: {"question": str, "answer": str}
    (or a PromptSample-like object with .prompt / .answer)."""

    async def agent(base_url: str, api_key: str, sample: Any) -> float:
        question = sample["question"] if isinstance(sample, dict) else sample.prompt
        answer = sample["answer"] if isinstance(sample, dict) else sample.answer
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages: list[dict[str, Any]] = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        messages.append({"role": "user", "content": question})
        try:
            for _ in range(max_turns):
                r = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                         tool_choice="auto", max_tokens=max_tokens,
                                                         temperature=temperature)
                msg = r.choices[0].message
                messages.append(msg.model_dump(exclude_none=True))
                if not msg.tool_calls:
                    break
                for call in msg.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": run_tool(call.function.name, call.function.arguments)})
        finally:
            await client.close()
        final = messages[-1].get("content") if messages[-1]["role"] == "assistant" else None
        return 1.0 if (final or "").strip() == str(answer).strip() else 0.0

    return agent
