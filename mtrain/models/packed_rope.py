"""RoPE for a THD-packed stream without megatron-core's per-sequence loop (issue 18, host overhead).

megatron-core 0.16.1 applies RoPE to packed sequences in `_apply_rotary_pos_emb_thd` (rope_utils.py), for the
query and the key of every layer: `cu_seqlens` differences `.tolist()`, a `freqs.size(0) == cu_seqlens[-1]` test
read on the host, `torch.split` of the stream into its n sequences, n slices of the frequency table and a `cat`:
13 + n top-level ops per call (measured, benchmarks/bench_packed_host_ops.py; 16 with this module at any n),
2 calls per layer per forward, so the count grows with sequences x layers
(benchmarks/bench_packed_host_ops.py). Its first branch ("exact mapping", freqs holding one row per token of the
stream, taken when `freqs.size(0) == cu_seqlens[-1]`) with a single segment [0, S] is the plain (bshd) rotation
with per-token frequencies.

So, where it is safe (mtrain's local attention reads its own copies of the real `cu_seqlens`; no context
parallelism, no MLA, plain RoPE or YaRN; `Actor.rope_per_token`): the trainer hands megatron-core `cu_seqlens = [0, S]`
(host) and the stream's position ids (`PackedSeqParams.mtrain_rope_positions`, each token's position inside its
own sequence), and `PerTokenRotaryEmbedding` returns the frequency table gathered at those positions, once per
forward ([S, 1, 1, d]). Every token gets exactly the row megatron's per-sequence slicing gives it (freqs[0:L_i]
for sequence i), so the rotation is bit-for-bit the same; the per-layer cost no longer depends on n. YaRN's table
is taken the same way; its cos/sin scale is not in the table (Attention applies it from the config), so nothing
else changes.
"""
from __future__ import annotations

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding


class _PerToken:
    """For a packed stream carrying `mtrain_rope_positions`: one frequency row per token (freqs[positions]) instead
    of the [max_seqlen, 1, 1, d] table. GPTModel calls get_rotary_seq_len with the micro-batch's PackedSeqParams
    right before forward; the positions are taken from there."""

    _mtrain_positions = None

    def get_rotary_seq_len(self, inference_context, transformer, transformer_input, transformer_config,
                           packed_seq_params=None, **kwargs):
        self._mtrain_positions = getattr(packed_seq_params, "mtrain_rope_positions", None) \
            if packed_seq_params is not None else None
        return super().get_rotary_seq_len(inference_context, transformer, transformer_input, transformer_config,
                                          packed_seq_params, **kwargs)

    def _rows(self, emb, packed_seq: bool):
        pos, self._mtrain_positions = self._mtrain_positions, None
        if pos is None or not packed_seq:
            return emb
        return emb.index_select(0, pos.to(emb.device))  # [S, 1, 1, d]


class PerTokenRotaryEmbedding(_PerToken, RotaryEmbedding):
    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        return self._rows(super().forward(max_seq_len, offset, packed_seq, cp_group), packed_seq)  # megatron's table


class PerTokenYarnRotaryEmbedding(_PerToken, YarnRotaryEmbedding):
    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        emb, mscale = super().forward(max_seq_len, offset, packed_seq, cp_group)  # megatron's table and scale
        return self._rows(emb, packed_seq), mscale


_PER_TOKEN = {RotaryEmbedding: PerTokenRotaryEmbedding, YarnRotaryEmbedding: PerTokenYarnRotaryEmbedding}


def install(chunks) -> bool:
    """Make every chunk's RotaryEmbedding (YarnRotaryEmbedding) a PerTokenRotaryEmbedding (PerTokenYarnRotaryEmbedding):
    same state, same table; False (and nothing changed) when some chunk with a rotary embedding has another kind
    (MRoPE) or MLA."""
    found = []
    for c in chunks:
        while hasattr(c, "module"):
            c = c.module
        rope = getattr(c, "rotary_pos_emb", None)
        if rope is None:
            continue  # a model without RoPE in this chunk: nothing to change
        if type(rope) not in (*_PER_TOKEN, *_PER_TOKEN.values()) or getattr(c.config, "multi_latent_attention", False) \
                or getattr(c, "position_embedding_type", None) not in ("rope", "yarn"):
            return False
        found.append(rope)
    if not found:
        return False
    for rope in found:
        rope.__class__ = _PER_TOKEN.get(type(rope), type(rope))
    return True
