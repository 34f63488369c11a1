"""PPO's critic as the learner sees it: one object called at fixed places (after the policy's update, offload /
reload, checkpoint), a no-op at each of them for the critic-free algorithms. Its advantages are the learner's
`CriticGAE` estimator (learner/advantages.py)."""
from __future__ import annotations

import json
from pathlib import Path

from mtrain.layouts import model_layout
from mtrain.trainer.learner.offload import TrainOffload
from mtrain.trainer.learner.ppo_step import CriticStep


class SideModels:
    def __init__(self, cfg, rank: int, train_config: dict, policy_loader, overrides: dict, offload: bool):
        self.cfg = cfg
        self.critic = self.critic_step = None
        self._critic_offload = None
        if cfg.algo.name == "ppo":
            from mtrain.trainer.learner.critic import Critic, critic_config
            from mtrain.trainer.engines import weight_loader
            hf_config, load = train_config, policy_loader
            if cfg.critic.hf_path is not None:  # its own weights (and architecture), on the policy's layout
                hf_config = dict(json.loads((Path(cfg.critic.hf_path) / "config.json").read_text()),
                                 num_nextn_predict_layers=0)
                load = weight_loader(critic_config(cfg), model_layout(hf_config, mtp=False), rank)
            self.critic = Critic(cfg, hf_config, load_weights=load, overrides=overrides)
            self.critic_step = CriticStep(cfg, self.critic)
            self._critic_offload = TrainOffload(self.critic, offload)

    @property
    def policy_trains(self) -> bool:
        """False during the critic's warm-up steps (critic.warmup_steps): only the critic is updated."""
        return self.critic is None or self._step >= self.cfg.critic.warmup_steps

    _step = 0

    def begin(self, step: int) -> None:
        self._step = step

    def update(self, minibatches: list, slices: list) -> dict[str, float]:
        if self.critic_step is None:
            return {}
        return self.critic_step.update([(m[0], sl, m[4]) for m, sl in zip(minibatches, slices)])

    def offload(self) -> dict[str, float]:
        return {} if self._critic_offload is None else _prefixed(self._critic_offload.offload())

    def reload(self) -> dict[str, float]:
        return {} if self._critic_offload is None else _prefixed(self._critic_offload.reload())

    def extra_models(self) -> dict:
        """What a checkpoint holds besides the policy (checkpoint.save / load's extra)."""
        return {} if self.critic is None else {"critic": self.critic}


def _prefixed(m: dict[str, float]) -> dict[str, float]:
    return {f"critic/{k}": v for k, v in m.items()}
