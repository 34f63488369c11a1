"""Rollout routing replay (R3) on megatron-core: every MoE router of the trainer uses the engine's experts.

megatron-core's extension point: with `moe_enable_routing_replay` each `TopKRouter` owns a `RouterReplay`
(moe/router_replay.py) whose `get_replay_topk` returns `target_topk_idx` (action REPLAY_FORWARD) or pops the
oldest of `replay_backward_list` (REPLAY_BACKWARD), gathering the router's own scores at those ids, so the
combine weights stay differentiable. We drive those instances directly, per router, never through the class-wide
list (its order mixes model chunks and every model built in the process):

- per micro-batch and model chunk, just before Megatron's schedule runs that chunk's forward (`feed`, called from
  the Actor's forward step), each router of the chunk gets the ids of *its* layer (`layer_number`, global across
  pipeline / virtual stages) for exactly the tokens it sees: the micro-batch in Megatron's [s, b] token order
  (padded rows, or the packed THD stream), this context-parallel rank's positions, this TP rank's sequence slice
  under sequence parallelism;
- `set_target_indices` also queues the ids for the backward; a forward pre-hook on every router picks the action
  per call: inside autograd's backward (activation recompute, `torch._C._current_graph_task_id() != -1`)
  REPLAY_BACKWARD pops the ids of the micro-batch being recomputed (the schedule recomputes micro-batches in the
  order it ran them, per chunk), otherwise REPLAY_FORWARD;
- after the schedule (`finish`) the ids are dropped and every router is back to its own top-k.

Positions without an engine record (each sequence's last token, padding) are replayed with `RoutingShape.filler()`;
they feed no logprob. While replaying, a forward hook can also compute what the router would have chosen itself
and count the tokens x layers whose expert *set* differs from the engine's (`measure`): the routing disagreement
metric, from the same pass.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from mtrain.rollout.routing import RoutingError, RoutingShape


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class RouterReplayFeeder:
    """The replay routers of the model chunks, fed one micro-batch at a time.

    own=False (algo.routing_replay=rollout): the ids come from the batch (the engine's record).
    own=True (algo.routing_replay=trainer): the scoring pass records every router's own choice (Megatron's RECORD
    action), per micro-batch, and the next update of the same batch replays it (`record_pass` / `replay_pass`)."""

    def __init__(self, chunks: list, shape: RoutingShape, config, own: bool = False) -> None:
        if config.moe_router_fusion:
            raise RoutingError("routing replay needs moe_router_fusion=False: the fused top-k kernel bypasses "
                               "megatron-core's RouterReplay")
        self.shape, self.config, self.own = shape, config, own
        # Only a backward that recomputes the router (full recompute, or selective with "moe") pops the queued ids;
        # otherwise keeping one copy per micro-batch until the step ends would only cost memory.
        self._recomputes = config.recompute_granularity == "full" or (
            config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or []))
        self._recording: dict[int, list] | None = None  # own: id(router) -> ids per micro-batch, while recording
        self._passes: list[dict[int, list]] = []  # own: recorded scoring passes waiting for their update
        self._replaying: dict[int, list] | None = None
        self.routers: dict[int, list[TopKRouter]] = {}  # id(chunk) -> its decoder routers
        for chunk in chunks:
            mine = []
            for name, m in chunk.named_modules():
                if not isinstance(m, TopKRouter) or ".mtp." in f".{name}.":
                    continue  # MTP heads: SGLang never captures draft routing; they route themselves
                if m.router_replay is None:
                    raise RoutingError("routing replay: the model was built without moe_enable_routing_replay")
                layer = int(m.layer_number) - 1
                if layer not in shape.moe_layers:
                    raise RoutingError(f"routing replay: a router at layer {layer} where the config has no MoE layer "
                                       f"(MoE layers {list(shape.moe_layers)})")
                m.register_forward_pre_hook(self._choose_action)
                m.register_forward_hook(self._measure_hook)
                mine.append(m)
            self.routers[id(chunk)] = mine
        self.measure = False
        self._valid: dict[int, torch.Tensor] = {}  # id(router) -> [tokens] bool for the current micro-batch
        self.differ = torch.zeros((), dtype=torch.float64)
        self.counted = torch.zeros((), dtype=torch.float64)

    # ---------------------------------------------------------------- hooks
    def _choose_action(self, router, args) -> None:
        if self._recording is not None and not _in_backward():
            router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
            return
        if router.router_replay.target_topk_idx is None:
            return  # not fed: the router computes its own top-k
        router.router_replay.set_router_replay_action(
            RouterReplayAction.REPLAY_BACKWARD if _in_backward() else RouterReplayAction.REPLAY_FORWARD)

    def _measure_hook(self, router, args, output) -> None:
        if self._recording is not None and not _in_backward():
            ids = router.router_replay.get_recorded_indices()
            self._recording.setdefault(id(router), []).append(ids.detach().to(self.shape.dtype))
            return
        if not self.measure or _in_backward() or router.router_replay.target_topk_idx is None:
            return
        with torch.no_grad():
            logits = router.gating(args[0]).view(-1, self.config.num_moe_experts)
            c = self.config
            _, own = topk_routing_with_score_function(
                logits, router.topk, use_pre_softmax=c.moe_router_pre_softmax, num_groups=c.moe_router_num_groups,
                group_topk=c.moe_router_group_topk, scaling_factor=c.moe_router_topk_scaling_factor,
                score_function=router.score_function, expert_bias=router.expert_bias, fused=False, router_replay=None)
            differ = (own != output[1]).any(-1)
            valid = self._valid[id(router)].to(differ.device)
            self.differ += float(differ[valid].sum())
            self.counted += float(valid.sum())

    # ---------------------------------------------------------------- per micro-batch
    def feed(self, chunk, mb: dict) -> None:
        """Give every router of `chunk` its layer's ids for micro-batch `mb` (as built by Actor._micro)."""
        routers = self.routers.get(id(chunk))
        if not routers:
            return
        if self.own:
            self._feed_own(routers, mb)
            return
        if "pack" in mb:  # [S, L, k] along the packed stream -> [S, 1, L, k]
            ids, valid = mb["packed/routed_experts"].unsqueeze(1), mb["routing_valid"].unsqueeze(1)
            if "cp_positions" in mb:  # this context-parallel rank's positions of the stream
                ids, valid = ids[mb["cp_positions"]], valid[mb["cp_positions"]]
        else:  # rows [b, T, L, k] -> Megatron's [s, b] order
            ids, valid = mb["routing"].transpose(0, 1), mb["routing_valid"].transpose(0, 1)
        s, b = ids.shape[:2]
        if tuple(mb["tokens"].shape) != (b, s):
            raise RoutingError(f"routing replay: micro-batch routing covers [{b}, {s}] tokens, the model input is "
                               f"{list(mb['tokens'].shape)}")
        if self.config.sequence_parallel:  # this TP rank's slice of the sequence
            tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            if s % tp:
                raise RoutingError(f"routing replay: sequence of {s} tokens does not split over {tp} TP ranks")
            ids, valid = ids[r * s // tp:(r + 1) * s // tp], valid[r * s // tp:(r + 1) * s // tp]
        ids = ids.reshape(-1, self.shape.num_layers, self.shape.top_k).long()
        valid = valid.reshape(-1).bool()
        # unrecorded positions (a packed stream's padding segment holds zeros): distinct valid ids
        ids = torch.where(valid[:, None, None], ids, self.shape.filler().long().to(ids.device))
        for router in routers:
            layer = router.layer_number - 1
            self._set(router, ids[:, layer].contiguous())
            self._valid[id(router)] = valid

    # ---------------------------------------------------------------- own routing (algo.routing_replay=trainer)
    def record_pass(self) -> None:
        """The next schedule (a scoring pass) records every router's own ids, per micro-batch."""
        self._recording = {}

    def replay_pass(self) -> None:
        """The next schedule (an update) replays the oldest recorded scoring pass: the same batch, micro-batched the
        same way (Actor._micro is deterministic), so its k-th micro-batch gets the k-th recorded ids."""
        if not self._passes:
            raise RoutingError("algo.routing_replay=trainer: no recorded scoring pass for this update (score the "
                               "batch with Actor.logprobs first)")
        self._replaying = self._passes.pop(0)

    def _feed_own(self, routers: list, mb: dict) -> None:
        if self._replaying is None:
            return  # a scoring pass (recording) or a plain forward: the routers choose themselves
        tokens = mb["tokens"].numel() // (ps.get_tensor_model_parallel_world_size() if self.config.sequence_parallel
                                          else 1)
        for router in routers:
            queue = self._replaying.get(id(router))
            if not queue:
                raise RoutingError(f"algo.routing_replay=trainer: the update runs more micro-batches than its scoring "
                                   f"pass recorded (layer {router.layer_number - 1})")
            ids = queue.pop(0)
            if ids.shape[0] != tokens:
                raise RoutingError(f"algo.routing_replay=trainer: recorded ids of {ids.shape[0]} tokens for a "
                                   f"micro-batch of {tokens} (layer {router.layer_number - 1}): the update's batch "
                                   f"is not the one scored")
            self._set(router, ids.to(mb["tokens"].device).long())

    def _set(self, router, ids: torch.Tensor) -> None:
        router.router_replay.set_target_indices(ids)  # also queues them for a recomputing backward
        if not (self._recomputes and torch.is_grad_enabled()):
            router.router_replay.replay_backward_list.pop()

    def finish(self) -> None:
        """After a schedule: drop every queued id and give the routers back their own top-k."""
        if self._recording is not None:
            self._passes.append(self._recording)
            self._recording = None
        self._replaying = None
        for routers in self.routers.values():
            for r in routers:
                r.router_replay.clear_indices()
                r.router_replay.clear_router_replay_action()
        self._valid = {}

    def take_disagreement(self) -> dict[str, float]:
        """Share of (token, MoE layer) pairs whose own expert set differs from the engine's, over every rank's
        counts since the last call (a collective: every rank calls it)."""
        t = torch.stack([self.differ, self.counted]).to(torch.float64)
        if torch.distributed.is_initialized():
            from mtrain.dist import train_group
            group = train_group()  # separate placement: the training ranks' gloo group (engine ranks count nothing)
            if group is None:
                t = t.to("cuda" if torch.cuda.is_available() else "cpu")
            torch.distributed.all_reduce(t, group=group)
        self.differ.zero_()
        self.counted.zero_()
        differ, counted = float(t[0]), float(t[1])
        return {"routing/disagreement": differ / counted} if counted else {}


def routing_metrics(actor, samples=None) -> dict[str, float]:
    """A step's routing-replay metrics (collective when the actor replays): the disagreement its scoring passes
    measured, what the stored routing costs per token, and what the engines really sent for the step's `samples`
    (its Completions or Trajectories), in SGLang's int32 payload bytes per stored row and per sample
    (`routing.received_bytes`; without samples, the payload of one row)."""
    if actor.replay is None or actor.routing is None:  # off, or trainer (no engine routing to compare with)
        return {}
    from mtrain.rollout.routing import received_bytes
    sent = received_bytes(samples or [], actor.routing) or {
        "routing/engine_bytes_per_token": float(actor.routing.sglang_bytes_per_token)}
    return {**actor.replay.take_disagreement(), "routing/bytes_per_token": float(actor.routing.bytes_per_token),
            **sent}
