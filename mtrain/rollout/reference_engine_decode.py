"""The decoding loop of the CPU reference engine: a group of requests of one prompt length, prefilled and decoded in
lock step with one KV cache (a mixin of ReferenceEngine, reference_engine.py, which owns the model and the state it
uses). What a sampled token and its logprob are is reference_engine_sampling.py's."""
from __future__ import annotations

import os
import time

import torch
from transformers import DynamicCache

from mtrain.rollout.protocol import Completion, Request, TokenDelta, emit_tokens
from mtrain.rollout.reference_engine_sampling import sample_token, top_alternatives
from mtrain.rollout.vision_requests import vision_prefill


class ReferenceDecoding:
    """_generate_group: one request group from prefill to its last token."""

    def _is_aborted(self, rid: str) -> bool:
        with self._abort_lock:
            return rid in self._aborted

    @torch.no_grad()
    def _generate_group(self, reqs: list[Request]) -> list[Completion]:
        """Decode requests that share one prompt length, in lock step, with one KV cache."""
        outputs: list[list[int]] = [[] for _ in reqs]
        logprobs: list[list[float]] = [[] for _ in reqs]
        versions: list[list[int]] = [[] for _ in reqs]  # per token: the weights that produced it (pause_in_place)
        tops: list[list | None] = [[] if r.params.top_logprobs else None for r in reqs]
        finish: list[str | None] = [None] * len(reqs)
        gens = []
        for req in reqs:
            seed = req.params.seed if req.params.seed is not None else int.from_bytes(os.urandom(7), "little")
            gens.append(torch.Generator().manual_seed(seed))
        alive = list(range(len(reqs)))  # rows of the current batch -> request index
        cache = DynamicCache(config=self._model.config)
        length = len(reqs[0].prompt_ids)
        input_ids = torch.tensor([r.prompt_ids for r in reqs], dtype=torch.long)
        positions = torch.arange(length).unsqueeze(0)
        vision_kwargs, deltas = {}, None
        routed: list[list[torch.Tensor]] = [[] for _ in reqs]  # per request: [tokens, L, k] per forward
        while True:
            self._gate()  # a pause in place stops here; the KV cache of every row is kept across it
            # abort is checked between decoding steps (and before the prefill of a queued group)
            for i in alive:  # a request that finished last step stays finished (its stop token is in the output)
                if finish[i] is None and self._is_aborted(reqs[i].rid):
                    finish[i] = "abort"
            keep = [row for row, i in enumerate(alive) if finish[i] is None]
            if len(keep) != len(alive):
                if not keep:
                    break
                if cache.get_seq_length() > 0:
                    cache.batch_select_indices(torch.tensor(keep))
                input_ids, alive = input_ids[keep], [alive[row] for row in keep]
                if deltas is not None:
                    deltas = deltas[keep]
            prefill = cache.get_seq_length() == 0
            if self._vlm and prefill:  # [3, B, L] multimodal positions of the rows still alive; images enter here only
                vision_kwargs, position_ids, deltas = vision_prefill(self._model, [reqs[i] for i in alive], input_ids)
            elif self._vlm:
                position_ids = (positions + deltas).view(1, -1, 1).expand(3, -1, -1)
                vision_kwargs = {}
            else:
                position_ids = positions.expand(len(alive), -1)
            if self._routing is not None:
                self._routing.start(input_ids.shape)
            logits = self._model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True,
                                 logits_to_keep=1, **vision_kwargs).logits[:, -1, :].float()
            if self._routing is not None:
                for row, rows in enumerate(self._routing.finish()):
                    routed[alive[row]].append(rows)
            next_ids = []
            for row, i in enumerate(alive):
                params = reqs[i].params
                token, logprob = sample_token(logits[row], params, gens[i])
                outputs[i].append(token)
                logprobs[i].append(logprob)
                versions[i].append(self._token_version())
                if tops[i] is not None:
                    tops[i].append(top_alternatives(logits[row], params))
                next_ids.append(token)
                if token in params.stop_token_ids:
                    finish[i] = "stop"
                elif len(outputs[i]) >= params.max_new_tokens:
                    finish[i] = "length"
            with self._abort_lock:
                for i in alive:
                    self._progress[reqs[i].rid] = len(outputs[i])
            for i in alive:  # streaming: this step's token of every request that asked for deltas
                if reqs[i].on_tokens is not None:
                    emit_tokens(reqs[i], TokenDelta([outputs[i][-1]], [logprobs[i][-1]],
                                                    [tops[i][-1]] if tops[i] is not None else None))
            if self._decode_delay_s:
                time.sleep(self._decode_delay_s)
            input_ids = torch.tensor(next_ids, dtype=torch.long).unsqueeze(1)
            positions = torch.tensor([[length]])
            length += 1
            if all(finish[i] is not None for i in alive):
                break
        now = self._token_version()
        return [Completion(rid=r.rid, prompt_ids=list(r.prompt_ids), output_ids=outputs[i], logprobs=logprobs[i],
                           finish_reason=finish[i], weight_version=now,  # type: ignore[arg-type]
                           # only when an update in place fell inside the request (else all weight_version)
                           token_versions=versions[i] if any(v != now for v in versions[i]) else None,
                           top_logprobs=tops[i], vision=r.vision,
                           # none for a request aborted before its prefill, as SGLang gives none for one aborted in its queue
                           routed_experts=self._routed_from(routed[i], r.routed_experts_start),
                           routed_experts_start=r.routed_experts_start)
                for i, r in enumerate(reqs)]

    def _routed_from(self, per_forward: list[torch.Tensor], start: int) -> torch.Tensor | None:
        """A request's rows from input position `start` on, as SGLang's routed_experts_start_len returns them. Every
        row is recorded anyway (the forward routes every token): the saving is in what the caller receives."""
        if self._routing is None or not per_forward:
            return None
        return torch.cat(per_forward)[start:].clone()
