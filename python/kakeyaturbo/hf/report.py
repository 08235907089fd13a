"""Per-layer memory accounting: the bytes a compressed layer holds, measured from what it
holds."""

from __future__ import annotations

from .blocks import storage_bytes


class LayerMemory:
    """:meth:`memory_report` of a :class:`~kakeyaturbo.hf.layer.KakeyaLayer`."""

    def _dense_tokens(self) -> int:
        """Tokens transformers' own layer would hold in this one's place."""
        return self._len

    def memory_report(self) -> dict:
        """Bytes this layer holds, measured from what it holds."""
        seen, compressed = set(), 0
        if self._on_device is not None:  # the only copy, as the device holds it
            compressed = sum(held.nbytes for held in self._on_device.values())
        for blk in self._blocks:
            for coded in (blk.k, blk.v) if blk.k is not None else ():
                compressed += coded.norm_bytes
                for enc in coded.encs:
                    if id(enc) not in seen:  # rows repeated by batch_repeat_interleave share
                        seen.add(id(enc))
                        compressed += int(enc.nbytes)
        full = sum(storage_bytes(t) for t in (self._hot_k, self._hot_v, self._sink_k, self._sink_v))
        aux = storage_bytes(self._hot_pos) + storage_bytes(self._sink_idx)
        if self._sink_slots is not self._sink_idx:  # the host's copy (a model off the CPU)
            aux += storage_bytes(self._sink_slots)
        # A flush's blocks hold views of one tensor of their positions: each storage once.
        held_pos = {
            b.pos.untyped_storage().data_ptr(): b.pos for b in self._blocks if b.pos is not None
        }
        aux += sum(storage_bytes(p) for p in held_pos.values())
        device_copy = 0
        if self._held is not None:  # which sinks sit in blocks, kept for attention
            aux += storage_bytes(self._held.sinks)
            device_copy = sum(held.nbytes for held in self._held.on_device.values())
        # The constant RoPE table counts while the layer holds tokens (reset frees the rest).
        if self._rope is not None and self.is_initialized:
            aux += storage_bytes(self._rope.inv_freq)
        aux += self._ctx.pipeline.frame_bytes(self.layer_idx)
        decoded = sum(storage_bytes(t) for b in self._blocks if b.decoded for t in b.decoded)
        decoded += storage_bytes(self._buf_k) + storage_bytes(self._buf_v)
        if self.is_initialized:
            per_token = self._rows * self._heads * (self._hot_k.shape[-1] + self._v_dim)
            dense = per_token * self._dense_tokens() * self.dtype.itemsize
            bf16 = per_token * self._dense_tokens() * 2
        else:
            dense = bf16 = 0
        return report(
            "compressed",
            self.get_seq_length(),
            self.compressed_length,
            compressed,
            full,
            aux,
            decoded,
            bf16,
            dense,
            device_copy,
        )


def report(
    kind, tokens, compressed_tokens, compressed, full, aux, decoded, bf16, dense, device_copy=0
) -> dict:
    """One layer's report from the bytes it holds of each kind (the keys ``memory_report``
    documents); shared by compressed and plain layers."""
    total = compressed + full + aux + decoded + device_copy
    return {
        "kind": kind,
        "tokens": tokens,
        "compressed_tokens": compressed_tokens,
        "compressed_bytes": compressed,
        "full_precision_bytes": full,
        "aux_bytes": aux,
        "decoded_cache_bytes": decoded,
        "device_copy_bytes": device_copy,
        "total_bytes": total,
        "bf16_equivalent_bytes": bf16,
        "dense_bytes": dense,
        "ratio": dense / total if total else 1.0,
        "ratio_vs_bf16": bf16 / total if total else 1.0,
    }


def compression_note(layers: list[dict], residual_length: int, sinks: int, block_size: int) -> str:
    """A line saying what a cache's per-layer reports ``layers`` show compressed and, while
    nothing is, why: a layer codes its oldest ``block_size`` tokens only once it holds more
    than its hot window of ``residual_length`` exact tokens."""
    coded = [r for r in layers if r["kind"] == "compressed"]
    if not coded:
        return "no layer is compressed: every layer holds its tokens at full precision"
    held, done = max(r["tokens"] for r in coded), max(r["compressed_tokens"] for r in coded)
    start = residual_length + block_size
    if done:
        return (
            f"{done} of {held} tokens per compressed layer are coded in blocks of {block_size}; "
            f"the newest {residual_length} or more (the hot window) and the first {sinks} "
            "(sinks) are held exact"
        )
    return (
        f"nothing is compressed yet: each compressed layer holds all {held} tokens exact (the "
        f"first {sinks} as attention sinks, the newest {residual_length} as the hot window), "
        f"and blocks of {block_size} tokens start being coded once a layer holds {start} "
        "tokens; until then the exact tokens' spare room and bookkeeping can make the cache "
        "larger than a plain one (a ratio below 1)"
    )
