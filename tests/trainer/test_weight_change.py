"""train.log_weight_change: the metrics count what an optimizer step does to the bf16 model weights and to the float32
main copy, checked against counts and norms computed here in float64."""
from __future__ import annotations

import torch

from mtrain.trainer.weight_change import WeightChange


class _MixedPrecision:
    """What WeightChange reads of megatron's Float16OptimizerWithFloat16Params: float32 main copies per group, a
    step that updates them and writes their bf16 rounding into the model parameters."""

    def __init__(self, params, lr):
        self.params = params
        self.fp32_from_float16_groups = [[p.detach().float().clone() for p in params]]
        self.lr = lr

    def step(self):
        for p, m in zip(self.params, self.fp32_from_float16_groups[0]):
            m.add_(self.lr * torch.sign(p.grad.float()))
            p.data.copy_(m)


def test_bf16_weights_move_only_past_half_an_ulp():
    torch.manual_seed(0)
    w = torch.nn.Parameter((torch.randn(256, 64) * 0.05).to(torch.bfloat16))
    w.grad = torch.randn_like(w)
    opt = _MixedPrecision([w], lr=5e-6)
    first_model, first_main = w.detach().double().clone(), opt.fp32_from_float16_groups[0][0].double().clone()
    tracker = WeightChange([w], opt)
    for _ in range(3):
        before = w.detach().clone()
        tracker.before_step()
        opt.step()
        m = tracker.after_step()
        assert m["weights/changed_frac"] == float((w.detach() != before).double().mean())
    main = opt.fp32_from_float16_groups[0][0].double()
    assert m["weights/changed_frac_total"] == float((w.detach().double() != first_model).double().mean())
    assert abs(m["weights/main_rel_change"] - float((main - first_main).norm() / first_main.norm())) < 1e-12
    assert abs(m["weights/model_rel_change"] - float((w.detach().double() - first_model).norm()
                                                    / first_model.norm())) < 1e-12
    # 3 steps of 5e-6 move the main copy by 1.5e-5 per element: only weights under ~2^-4 in magnitude can change
    assert 0 < m["weights/changed_frac_total"] < 0.5 and m["weights/main_rel_change"] > m["weights/model_rel_change"]


def test_float32_model_main_copy_is_the_model():
    p = torch.nn.Parameter(torch.randn(32, 8))
    opt = torch.optim.SGD([p], lr=0.1)
    tracker = WeightChange([p], opt)
    p.grad = torch.ones_like(p)
    tracker.before_step()
    opt.step()
    m = tracker.after_step()
    assert m["weights/changed_frac"] == 1.0 and m["weights/main_rel_change"] == m["weights/model_rel_change"] > 0
