"""The colocated-asynchrony memory check against the byte counts of Megatron's distributed-optimizer note
(bf16 weights 2 + fp32 grads 4 + fp32 master 4 + Adam moments 4 + 4 bytes per parameter; the last 12 divided over
the data-parallel ranks with the distributed optimizer; fp32 weights need no master copy)."""
from mtrain.trainer.memory_fit import GIB, fit_error, training_bytes

H200 = int(139.8 * GIB)


def test_training_bytes_formula():
    assert training_bytes(10**9, 2, 1, False) == 18 * 10**9
    assert training_bytes(10**9, 2, 4, True) == (6 + 12 / 4) * 10**9
    assert training_bytes(10**9, 4, 1, True) == (4 + 4 + 8) * 10**9
    assert training_bytes(10**9, 2, 8, False) == 18 * 10**9  # without the distributed optimizer nothing is sharded


def test_fit_and_refusal():
    # SmolLM2-135M next to an engine at 0.3 of an H200: fits
    assert fit_error(135 * 10**6, 2, 1, True, 0.3, H200, "stream") is None
    # an 8B model on one GPU: 144 GB of training state alone
    err = fit_error(8 * 10**9, 2, 1, True, 0.3, H200, "one_step")
    assert err is not None and "\n" not in err
    assert err.startswith("engine.mem_fraction_static: rollout.async=one_step keeps the engine resident")
    assert "134.1 GiB per rank (8000M parameters" in err and "> 139.8 GiB" in err
    # the same model over 8 data-parallel ranks with the distributed optimizer: 8e9 x 7.5 B = 55.9 GiB + 41.9 GiB
    assert fit_error(8 * 10**9, 2, 8, True, 0.3, H200, "stream") is None
    assert fit_error(8 * 10**9, 2, 8, True, 0.7, H200, "stream") is not None
