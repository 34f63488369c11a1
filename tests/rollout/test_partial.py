"""Partial rollout on the CPU reference engine: resumption, per-token versions, the off-policy corrections.

References: the same greedy request run uninterrupted (resumption must be token-exact under unchanged weights); the
engine's version at the time each token was produced; float64 math for the TIS weights; autograd for "masked tokens
contribute nothing to the gradient".
"""
import asyncio
import random

import torch

from mtrain.config import load_config
from mtrain.rollout import ReferenceEngine, Request, SamplingParams
from mtrain.rollout import partial
from mtrain.rollout.client import LocalClient
from aborts import abort_after

CONFIG = dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
              tie_word_embeddings=False)
GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0)


def test_resumed_greedy_sample_equals_uninterrupted_and_versions_follow_the_engine():
    engine = ReferenceEngine(CONFIG, init_seed=5, decode_delay_s=0.002)
    engine.finish_weight_update(3)  # version 3: the weights the first part is generated with
    client = LocalClient(engine)
    prompt = [7, 3, 11, 5]
    whole = engine.generate([Request("whole-", prompt, GREEDY)])[0]
    assert whole.finish_reason == "length" and len(whole.output_ids) == 40
    cut = random.Random(0).randint(5, 30)
    g = partial.new_group(uid=0, sample_index=0, prompt_ids=prompt, n=1, base_seed=0)

    async def first():
        abort_after(engine, "s0-", cut)
        return await partial.advance(g, client, GREEDY, "s0", score=lambda grp: ([0.0], [""]), filter_uniform=False)

    counts, g = asyncio.run(first())
    s = g.samples[0]
    assert not counts and s.finish_reason is None and cut <= len(s.output_ids) < 40, len(s.output_ids)
    k = len(s.output_ids)
    engine.finish_weight_update(4)  # a sync with the same weights: the rest is generated under version 4
    counts, g = asyncio.run(partial.advance(g, client, GREEDY, "s1", score=lambda grp: ([1.0], ["x"]),
                                            filter_uniform=False))
    s = g.samples[0]
    assert counts and s.finish_reason == "length" and g.rewards == [1.0]
    assert s.output_ids == whole.output_ids  # token-exact continuation
    assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(whole.logprobs), atol=1e-5)
    assert s.versions == [3] * k + [4] * (40 - k)
    c = g.completions()[0]
    assert c.versions == s.versions and c.prompt_ids == prompt
    # the buffer survives a checkpoint as plain data
    assert partial.from_state(partial.to_state([g])) == [g]
    engine.shutdown()


def test_offpolicy_mask_removes_old_tokens_from_loss_and_gradient():
    """The loop's rule (versions < current -> mask 0) on a hand-built batch: the loss and its gradient do not change
    when the old tokens' logprobs/advantages change, and their gradient is exactly 0."""
    from mtrain.algorithms.objective import policy_loss
    from mtrain.trainer.batch import build_batch
    from mtrain.rollout.protocol import Completion
    cfg = load_config(None, ["model.hf_path=x", "data.task=arithmetic", "rollout.partial=true", "algo.kl_coef=0"])
    comps = [Completion("a", [1, 2], [5, 6, 7, 8], [-1.0, -2.0, -0.5, -0.1], "stop", 2, token_versions=[1, 1, 2, 2]),
             Completion("b", [1, 2], [9, 4], [-0.3, -0.7], "length", 2, token_versions=[2, 2])]
    batch = build_batch(comps, [1.0, 0.0], pad_id=0)
    current = 2
    batch.response_mask[(batch.versions >= 0) & (batch.versions < current)] = 0.0
    assert batch.response_mask.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 0, 0]]

    def loss_and_grad(shift):
        lp = (batch.engine_logprobs + shift).clone().requires_grad_(True)
        adv = torch.tensor([[1.0] * 5, [-1.0] * 5]) + shift
        loss, _ = policy_loss(cfg.algo, lp, batch.engine_logprobs, adv, batch.response_mask)
        loss.backward()
        return loss.detach(), lp.grad
    old = (batch.versions >= 0) & (batch.versions < current)
    base_loss, base_grad = loss_and_grad(torch.zeros(2, 5))
    moved_loss, moved_grad = loss_and_grad(torch.where(old, 3.0, 0.0))
    assert torch.equal(base_loss, moved_loss) and torch.equal(base_grad, moved_grad)
    assert torch.all(base_grad[old] == 0) and torch.all(base_grad[batch.response_mask.bool()] != 0)


def test_tis_weights_equal_float64():
    from mtrain.algorithms.losses import truncated_is_weights
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 7, generator=g) * 3
    rollout = -torch.rand(3, 7, generator=g) * 3
    mask = (torch.rand(3, 7, generator=g) > 0.3).float()
    w = truncated_is_weights(old, rollout, mask, cap=2.0)
    ref = torch.minimum(torch.exp(old.double() - rollout.double()), torch.tensor(2.0, dtype=torch.float64)) * mask
    assert torch.allclose(w.double(), ref, rtol=1e-6, atol=0)


def test_length_budget_ramp_and_config_errors():
    import pytest
    from mtrain.config import ConfigError
    cfg = load_config(None, ["model.hf_path=x", "data.task=arithmetic", "rollout.max_new_tokens=100",
                             "rollout.max_new_tokens_start=20", "rollout.max_new_tokens_ramp_steps=4"])
    assert [partial.length_budget(cfg.rollout, s) for s in range(6)] == [20, 40, 60, 80, 100, 100]
    base = ["model.hf_path=x", "data.task=arithmetic"]
    with pytest.raises(ConfigError, match="rollout.over_sample: needs rollout.partial=true"):
        load_config(None, base + ["rollout.over_sample=2"])
    with pytest.raises(ConfigError, match="rollout.offpolicy: tis needs algo.tis_cap"):
        load_config(None, base + ["rollout.partial=true", "rollout.offpolicy=tis"])
    with pytest.raises(ConfigError, match="rollout.over_sample: must be >= 1"):
        load_config(None, base + ["rollout.partial=true", "rollout.over_sample=0.5"])
