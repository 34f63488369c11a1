"""An agent for the trainer tests, written only against the official `openai` client (as users write them)."""
from openai import AsyncOpenAI


async def two_turn_digits(base_url: str, api_key: str, sample) -> float:
    """Ask, then ask again after the model's answer; reward: share of digits in the second answer."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        model = (await client.models.list()).data[0].id
        messages = [{"role": "user", "content": sample.prompt}]
        for _ in range(2):
            r = await client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=1.0)
            messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                         {"role": "user", "content": "Again."}]
        text = messages[-2]["content"]
        return sum(c.isdigit() for c in text) / max(len(text), 1)
    finally:
        await client.close()
