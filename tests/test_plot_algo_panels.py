"""`mtrain plot` of a PPO run (no KL reference), of a distillation run (the critic's and the teacher's panels) and of
a GRPO run without a KL reference."""
from PIL import Image

from mtrain.metrics import MetricsWriter
from mtrain.plot import DPI, ROW_HEIGHT_IN, plot_run


def _run(tmp_path, extra):
    with MetricsWriter(tmp_path, tensorboard=False, progress=False) as w:
        for s in (1, 2, 3):
            w.log(s, {"reward/mean": 0.1 * s, "logprob_diff/max_abs": 0.0, **{k: v * s for k, v in extra.items()}})
    return Image.open(plot_run(tmp_path)).size[1] // int(ROW_HEIGHT_IN * DPI)


def test_ppo_run_plots_critic_panels_without_kl(tmp_path):
    assert _run(tmp_path / "ppo", {"critic/value_loss": 1.0, "critic/explained_var": 0.1,
                                   "critic/vpred_mean": 0.2}) == 5  # reward, logprob diff, three critic panels


def test_distill_run_plots_reverse_kl(tmp_path):
    assert _run(tmp_path / "d", {"distill/reverse_kl": 0.3, "kl/mean": 0.01}) == 4


def test_grpo_run_without_a_kl_reference_plots_reward_and_gap(tmp_path):
    # algo.kl_coef=0 logs no kl/mean (the math example's run); the default panels leave it out instead of failing
    assert _run(tmp_path / "grpo", {}) == 2
