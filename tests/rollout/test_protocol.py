"""The engine protocol's value types and expand_samples."""
import itertools

import pytest

from mtrain.rollout.protocol import Completion, Request, SamplingParams, expand_samples


def test_sampling_params_defaults_and_list_stop_ids_become_tuple():
    p = SamplingParams(stop_token_ids=[3, 4])
    assert p.stop_token_ids == (3, 4)
    assert hash(p) == hash(SamplingParams(stop_token_ids=(3, 4)))  # frozen + hashable
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (64, 1.0, 1.0, -1, None)
    assert SamplingParams(temperature=0).greedy and not p.greedy


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"stop_token_ids": (1, -1)}, "stop_token_ids"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
])
def test_sampling_params_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_completion_checks_lengths_and_finish_reason():
    with pytest.raises(ValueError, match="'r1': 2 output ids but 1 logprobs"):
        Completion("r1", [1], [2, 3], [-0.5], "stop", 0)
    with pytest.raises(ValueError, match="finish_reason must be one of"):
        Completion("r1", [1], [2], [-0.5], "eos", 0)


def test_expand_samples_distinct_seeds_prefix_free_rids_and_order():
    prompts = [[i, i + 1] for i in range(11)]  # 11 prompts, 12 samples: two-digit indices on both levels
    params = SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(2,), seed=99)
    reqs = expand_samples(prompts, 12, params, base_seed=1000, rid_prefix="step3")
    assert len(reqs) == 11 * 12
    assert all(isinstance(r, Request) for r in reqs)
    # prompt-major: group i is reqs[i*n:(i+1)*n]
    assert [r.prompt_ids for r in reqs] == [p for p in prompts for _ in range(12)]
    seeds = [r.params.seed for r in reqs]
    assert len(set(seeds)) == len(seeds) and min(seeds) == 1000
    rids = [r.rid for r in reqs]
    assert len(set(rids)) == len(rids)
    for a, b in itertools.permutations(rids, 2):
        assert not b.startswith(a), (a, b)  # SGLang aborts by prefix
    assert all(r.startswith("step3-") for r in rids)
    # a group's prefix selects exactly that group
    group_prefix = rids[12 * 3].rsplit("-", 2)[0] + "-"
    assert [r for r in rids if r.startswith(group_prefix)] == rids[36:48]
    # everything but the seed is kept
    assert all(r.params == SamplingParams(5, 0.7, 0.9, 20, (2,), r.params.seed) for r in reqs)
    # the prompt lists are copies, not aliases of the caller's lists
    reqs[0].prompt_ids.append(7)
    assert prompts[0] == [0, 1]


@pytest.mark.parametrize("kwargs, msg", [
    ({"n": 0}, "n must be an int >= 1"),
    ({"base_seed": -3}, "base_seed must be an int >= 0"),
    ({"rid_prefix": ""}, "rid_prefix must be a non-empty string"),
    ({"prompts": [[1], []]}, "prompt 1 is empty"),
])
def test_expand_samples_rejects_bad_input(kwargs, msg):
    args = {"prompts": [[1, 2]], "n": 2, "params": SamplingParams(), "base_seed": 0, "rid_prefix": "x"} | kwargs
    with pytest.raises(ValueError, match=msg):
        expand_samples(**args)
