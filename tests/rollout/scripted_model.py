"""A tiny Llama taught (in a few seconds of CPU) to say scripted turns, so the real reference engine drives real
multi-turn tool rollouts in tests: its greedy output is a tool call, then, after the tool's answer, the answer.

The model is trained on the exact token sequences the rollout builds (prompt, model turns + <eos>, the
template's suffix for the tool messages), loss on the model tokens only, until greedy decoding reproduces them.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from mtrain.data import CharTokenizer
from mtrain.rollout import ReferenceEngine
from mtrain.rollout.agents import tito
from mtrain.rollout.reference_engine import as_hf_config, hf_disk_views

CONFIG = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.05,
              tie_word_embeddings=False)


def script_tokens(tok: CharTokenizer, user: str, turns: list[str], tool_replies: list[list[dict]], tools=None):
    """(ids, trained mask) of one scripted conversation: model turns end with <eos>; tool replies between them."""
    _, ids = tito.prompt_ids(tok, [{"role": "user", "content": user}], tools)
    return append_turns(tok, ids, turns, tool_replies, tools)


def append_turns(tok, prompt_ids: list[int], turns: list[str], tool_replies: list[list[dict]], tools=None):
    """(ids, trained mask): the prompt (mask 0), then each model turn ending with <eos> (mask 1) and the tool replies
    after it as the chat template appends them (mask 0)."""
    ids, mask = list(prompt_ids), [0] * len(prompt_ids)
    for i, turn in enumerate(turns):
        t = tok.encode(turn, add_special_tokens=False) + [tok.eos_token_id]
        ids, mask = ids + t, mask + [1] * len(t)
        if i < len(tool_replies):
            _, s = tito.suffix(tok, tool_replies[i], tools, stop_text=tok.eos_token)
            ids, mask = ids + s, mask + [0] * len(s)
    return ids, mask


def train_scripted_model(sequences: list[tuple[list[int], list[int]]], steps: int = 400, seed: int = 0,
                         config: dict = CONFIG, device: str = "cpu", lr: float = 1e-2):
    """The HF model, trained until its loss on the model tokens is below 1e-3 (or `steps` Adam steps)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(as_hf_config(config), dtype=torch.float32,
                                             attn_implementation="eager").to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    width = max(len(s) for s, _ in sequences)
    x = torch.zeros((len(sequences), width), dtype=torch.long, device=device)
    m = torch.zeros((len(sequences), width), device=device)
    for i, (ids, mask) in enumerate(sequences):
        x[i, :len(ids)] = torch.tensor(ids, device=device)
        m[i, :len(mask)] = torch.tensor(mask, dtype=torch.float32, device=device)
    for step in range(steps):
        logits = model(x).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, x[:, 1:, None])[..., 0]
        loss = -(lp * m[:, 1:]).sum() / m[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    return model.cpu().eval()


def train_scripted_engine(sequences: list[tuple[list[int], list[int]]], steps: int = 400, seed: int = 0,
                          **engine_kwargs) -> ReferenceEngine:
    model = train_scripted_model(sequences, steps, seed)
    engine = ReferenceEngine(CONFIG, **engine_kwargs)
    views = hf_disk_views(model)
    engine.update_weights([[(k, v.detach().clone()) for k, v in views.items() if k in engine.parameter_specs()]])
    engine.finish_weight_update(1)
    return engine
