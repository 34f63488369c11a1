"""The prompt sampler: epoch permutations from the seed, full batches across epoch ends, exact resume."""
import pytest

from mtrain.data import PromptSampler, SamplerStateError


def draw(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


def test_every_epoch_is_a_permutation_and_batches_stay_full():
    s = PromptSampler(10, 4, seed=1)
    flat = [i for b in draw(s, 5) for i in b]  # 20 indices = exactly 2 epochs
    assert all(len(b) == 4 for b in draw(PromptSampler(10, 4, seed=1), 5))
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # each epoch reshuffles
    assert s.epoch == 2 and s.position == 0


def test_same_seed_same_stream_other_seed_differs():
    assert draw(PromptSampler(50, 8, seed=3), 10) == draw(PromptSampler(50, 8, seed=3), 10)
    assert draw(PromptSampler(50, 8, seed=3), 10) != draw(PromptSampler(50, 8, seed=4), 10)


def test_no_shuffle_is_file_order():
    assert draw(PromptSampler(5, 2, shuffle=False), 3) == [[0, 1], [2, 3], [4, 0]]


@pytest.mark.parametrize("stop_after", [0, 1, 3, 7])
def test_resume_from_state_dict_continues_the_exact_stream(stop_after):
    uninterrupted = draw(PromptSampler(13, 5, seed=9), 12)
    first = PromptSampler(13, 5, seed=9)
    head = draw(first, stop_after)
    state = first.state_dict()
    resumed = PromptSampler(13, 5, seed=9)
    resumed.load_state_dict(dict(state))  # e.g. after a round trip through a checkpoint
    assert head + draw(resumed, 12 - stop_after) == uninterrupted


def test_state_from_other_data_or_seed_is_rejected():
    state = PromptSampler(13, 5, seed=9).state_dict()
    with pytest.raises(SamplerStateError, match="num_samples=13 but this sampler has num_samples=14"):
        PromptSampler(14, 5, seed=9).load_state_dict(state)
    with pytest.raises(SamplerStateError, match="seed=9 but this sampler has seed=1"):
        PromptSampler(13, 5, seed=1).load_state_dict(state)
    with pytest.raises(SamplerStateError, match="out of range"):
        PromptSampler(13, 5, seed=9).load_state_dict({**state, "position": 13})


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        PromptSampler(0, 1)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        PromptSampler(3, 0)
