"""Control calls of the in-process SGLang engine: parameter dumps, activation taps, checksums, memory release/resume
and the cache flush (a mixin of SGLangEngine, sglang_engine.py, which owns the state and the loop plumbing it uses)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from typing import Any, Sequence

import torch

from mtrain.rollout.protocol import MEMORY_TAGS, EngineError
from mtrain.rollout.sglang_loader import DUMP_PARAMS, DUMP_PREFIX

SGLANG_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class SGLangControl:
    """dump_params / probe_activations / weight_checksums / randomize_weights / get_weights_by_name,
    release_memory / resume_memory / flush_cache."""

    def dump_params(self, out_dir: str, names: Sequence[str] | None = None, what: str = "sha256") -> list[str]:
        """Each engine rank writes `names` (all when None) to out_dir/rank<r>.json (sha256, shape, dtype per
        parameter) or .pt (CPU tensors). Returns the paths, rank order."""
        spec = DUMP_PREFIX + json.dumps({"dir": os.path.abspath(out_dir), "names": None if names is None
                                         else list(names), "what": what})
        self._send_control(spec, DUMP_PARAMS, "dump_params")
        ext = "json" if what == "sha256" else "pt"
        return [os.path.join(os.path.abspath(out_dir), f"rank{r}.{ext}") for r in range(self.tp_size)]

    def probe_activations(self, token_ids: list[int]) -> dict[str, Any]:
        """One prefill of `token_ids` with taps in the scheduler (mtrain/rollout/sglang_taps.py):
        {"taps": {point: [tokens, hidden] float32}, "logprobs": float32 [len - 1], SGLang's own input-token
        logprobs at temperature 1}. The cache is flushed first so every position is computed; the sequence
        must fit one prefill chunk (chunked_prefill_size) for the taps to hold all of it."""
        from mtrain.rollout.sglang_taps import TAP_ACTIVATIONS, tap_spec

        self.flush_cache()
        out_dir = tempfile.mkdtemp(prefix="mtrain-taps-")
        try:
            self._send_control(tap_spec("arm"), TAP_ACTIVATIONS, "probe_activations")
            out = self._run(self._engine.async_generate(
                input_ids=list(token_ids), sampling_params={"max_new_tokens": 1, "temperature": 1.0},
                return_logprob=True, logprob_start_len=0, rid=uuid.uuid4().hex), "probe_activations")
            self._send_control(tap_spec("dump", out_dir), TAP_ACTIVATIONS, "probe_activations")
            taps = torch.load(os.path.join(out_dir, "rank0.pt"))
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        entries = out["meta_info"]["input_token_logprobs"][1:]  # the first position has no logprob
        return {"taps": taps, "logprobs": torch.tensor([e[0] for e in entries], dtype=torch.float32)}

    def weight_checksums(self) -> list[dict]:
        """SGLang's own per-parameter checksums, one dict per TP rank (CheckWeightsReqInput, 0.5.17)."""
        obj = self._io.CheckWeightsReqInput(action="checksum")
        ok, message, ranks, _ = self._run(self._engine.tokenizer_manager.check_weights(obj, None),
                                          "weight_checksums")
        if not ok:
            raise EngineError(f"SGLangEngine.weight_checksums: {message}")
        return ranks or []

    def randomize_weights(self) -> None:
        """Overwrite every parameter with random values (SGLang's check_weights "reset_tensors"): tests use it
        so that a later sync provably writes everything it should."""
        obj = self._io.CheckWeightsReqInput(action="reset_tensors")
        ok, message, _, _ = self._run(self._engine.tokenizer_manager.check_weights(obj, None), "randomize_weights")
        if not ok:
            raise EngineError(f"SGLangEngine.randomize_weights: {message}")

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        """SGLang's get_weights_by_name: first `truncate_size` rows as float32 lists, from TP rank 0.
        Implemented by the Llama model class only among ours; None when the model lacks it or the name."""
        obj = self._io.GetWeightsByNameReqInput(name=name, truncate_size=truncate_size)
        return self._run(self._engine.tokenizer_manager.get_weights_by_name(obj, None), "get_weights_by_name")

    # -- memory and cache -------------------------------------------------------------------------------
    def _tags(self, tags: Sequence[str], what: str) -> list[str]:
        tags = list(tags)
        bad = [t for t in tags if t not in SGLANG_MEMORY_TAGS]
        if bad or not tags:
            raise EngineError(f"{what}: tags must be a non-empty subset of {SGLANG_MEMORY_TAGS}, got {tags}")
        return tags

    def release_memory(self, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        tags = self._tags(tags, "release_memory")
        again = [t for t in tags if t in self._released]
        if again:
            raise EngineError(f"release_memory: {again} already released")
        if self._inflight:
            # The scheduler asserts it is idle (scheduler weight_updater.py:203-205); an assert there kills us.
            raise EngineError(f"release_memory: {len(self._inflight)} requests still running")
        self._run(self._engine.tokenizer_manager.release_memory_occupation(
            self._io.ReleaseMemoryOccupationReqInput(tags=tags), None), "release_memory")
        self._released.update(tags)

    def resume_memory(self, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        tags = self._tags(tags, "resume_memory")
        missing = [t for t in tags if t not in self._released]
        if missing:
            # Resuming a tag that is not released raises KeyError in the scheduler (weight_updater.py:254-255).
            raise EngineError(f"resume_memory: {missing} not released")
        self._run(self._engine.tokenizer_manager.resume_memory_occupation(
            self._io.ResumeMemoryOccupationReqInput(tags=tags), None), "resume_memory")
        self._released.difference_update(tags)

    def flush_cache(self) -> None:
        out = self._run(self._engine.tokenizer_manager.flush_cache(), "flush_cache")
        if not getattr(out, "success", False):
            raise EngineError(f"flush_cache: SGLang refused (requests running?): {getattr(out, 'message', out)}")
