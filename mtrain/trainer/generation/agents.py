"""serve.agent: OpenAI-client agents generate the training data (server-based RL), through the pool.

Each engine leader serves its engine behind an OpenAI-compatible front (mtrain/serve/, started on first use, on an
ephemeral loopback port: several leaders may share a host). Per step, the pool hands each engine's leader GRPO groups;
group i runs the agent n times on sample i, each run in a session of its own; the sessions' recorded tokens, logprobs
and per-token versions become the trajectories the trainer's batch is built from (`to_batch`), and the agent's return
value is the reward. docs/design-openai-front.md.
"""
from __future__ import annotations

import inspect

from mtrain.config import ConfigError
from mtrain.data.rewards import load_object
from mtrain.rollout.pool import RolloutPool
from mtrain.trainer.generation.rollouts import RolloutResult


def load_agent(spec: str, model_name: str):
    """`module:name`: an agent `async (base_url, api_key, sample) -> reward`, or a factory `name(model_name) -> agent`
    (e.g. mtrain.rollout.agents.calculator_agent:make_calculator_agent)."""
    obj = load_object(spec, "agent", ConfigError)
    agent = obj if inspect.iscoroutinefunction(obj) else obj(model_name)
    if not inspect.iscoroutinefunction(agent) and not inspect.iscoroutinefunction(getattr(agent, "__call__", None)):
        raise ConfigError(f"serve.agent: {spec!r} is neither an async agent (base_url, api_key, sample) -> reward nor "
                          "a factory returning one")
    return agent


def _front(front, s):
    """The front with the session store serve.* bounds (the same as `mtrain serve`'s: the cap of what one session
    records); sessions are taken by the trainer, so no idle expiry here."""
    from mtrain.serve.sessions import SessionStore

    front.sessions = SessionStore(max_session_tokens=s.max_session_tokens)
    return front


class AgentRollout:
    """The `GenerationFunction` of server-based RL: openai-client agents through each leader's front. The agents
    choose their own sampling (greedy evaluation is theirs to do) and run on the pool of the call: the loop's, or
    rollout.async's background pool (its own gloo group and engine clients; one front per engine client, so the
    agents of a background rollout reach the engines through fronts of their own, while the loop's stay idle)."""
    reports_tool_metrics = False  # agents' trajectories carry their own metrics

    def __init__(self, cfg, tokenizer, *, max_positions: int, model_name: str):
        from mtrain.serve.openai_agent import FrontRegistry
        from mtrain.serve.api_key import api_key_of
        from mtrain.serve.front import OpenAIFront
        from mtrain.serve.server import FrontServer

        s = cfg.serve
        self.agent = load_agent(s.agent, model_name)
        api_key, _ = api_key_of(cfg)
        self.fronts = FrontRegistry(lambda client: FrontServer(
            _front(OpenAIFront(client, tokenizer, model_name=model_name, max_positions=max_positions,
                               default_max_tokens=s.default_max_tokens, tool_parser=s.tool_parser), s),
            host=s.host, port=0, api_key=api_key, max_body_bytes=s.max_body_kb << 10,
            max_concurrency=s.max_concurrency, shutdown_grace_s=s.shutdown_grace_s, read_timeout_s=s.read_timeout_s))

    def __call__(self, pool, samples, *, n, seed, prefix, greedy=False, max_new_tokens=None) -> RolloutResult:
        return self.run(pool, samples, n, prefix)

    def run(self, pool: RolloutPool, samples, n: int, rid_prefix: str) -> RolloutResult:
        from mtrain.serve.openai_agent import agent_group_fn

        with_images = [s.index for s in samples if getattr(s, "images", ())]
        if with_images:  # the OpenAI front takes text messages only
            raise ValueError(f"sample {with_images[0]} has images: serve.agent rollouts (the OpenAI front) do not "
                             f"support image prompts yet; multi_turn.rollout_fn runs tool rollouts with images")
        run = pool.run(len(samples), agent_group_fn(self.fronts, self.agent, samples, n, rid_prefix=rid_prefix),
                       rid_prefix=rid_prefix)
        trajectories = [t for group in run.results for t in group]
        missing = [t.rid for t in trajectories if t.reward is None]
        if missing:
            raise ConfigError(f"serve.agent returned no reward for {len(missing)} runs (e.g. {missing[0]}): an agent "
                              "returns a number, or posts one to /sessions/{id}/reward")
        out = RolloutResult([], [float(t.reward) for t in trajectories], [t.final_text for t in trajectories],
                            run.metrics(), trajectories=trajectories)
        for k in sorted({k for t in trajectories for k in t.metrics}):
            vals = [t.metrics[k] for t in trajectories if k in t.metrics]
            out.metrics[k] = sum(vals) / len(vals)
        out.metrics["perf/rollout_tokens_per_s"] = sum(t.num_model_tokens for t in trajectories) / max(run.seconds, 1e-9)
        return out

    def close(self) -> None:
        self.fronts.stop()
