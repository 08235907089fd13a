"""Attention sinks: the first ``sink_tokens`` real tokens of each row, held exact beside the
codes (found from the prefill's attention mask, so left padding is skipped). The pipeline codes
their block's mean in their place; the exact ones are written over their decoded slots, and
attention over the codes reads them from here."""

from __future__ import annotations

import torch


class SinkSlots:
    """A :class:`~kakeyaturbo.hf.layer.KakeyaLayer`'s sinks: which cache slots they sit in
    (``_sink_slots`` on the host, ``_sink_idx`` on the device) and their exact keys and values
    (``_sink_k``, ``_sink_v``). The state lives on the layer (``KakeyaLayer._clear``)."""

    def _init_sinks(self, q: int) -> None:
        """Pick each row's sink slots: its first `sink_tokens` real (unpadded) tokens when the
        prefill's 2-D attention mask is known, else the first slots."""
        s, b, start = self.sink_tokens, self._rows, self._len
        mask = self._ctx.step.attention_mask
        # Every layer of a forward picks alike: once (the memo holds the mask, so its id stays).
        key = (s, b, start, q, id(mask))
        idx, end, _ = self._ctx.step.once(
            "sink slots", key, lambda: pick_sink_slots(s, b, start, q, mask)
        )
        self._set_sink_slots(idx.clone())  # the layer's own (its bytes counted per layer)
        self._sink_end = end
        self._held = None
        self._sink_k = self._sink_v = None  # made by the first capture (_capture_sinks)

    def _set_sink_slots(self, idx: torch.Tensor) -> None:
        """``idx`` (host, ``[B, S]`` long) as the sinks' slots, on the host and the device."""
        self._sink_slots = idx
        self._sink_idx = idx.to(self.device)

    def _capture_sinks(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        if start >= self._sink_end:  # every sink slot is written (a decode step's case)
            return
        lo, hi = start, start + k.shape[-2]
        run = self._sink_run(lo, hi)
        if self._sink_k is None:
            if run is not None and run[2] == self.sink_tokens:
                # Every sink arrives now (a prompt's first forward): the sinks are their copies.
                at, n, dtype = run[1], run[2], self._hot_k.dtype
                same = {"memory_format": torch.contiguous_format, "copy": True}
                self._sink_k = k[:, :, at : at + n].transpose(1, 2).to(dtype, **same)
                self._sink_v = v[:, :, at : at + n].transpose(1, 2).to(dtype, **same)
                return
            b, s, h = self._rows, self.sink_tokens, self._heads
            self._sink_k = self._hot_k.new_zeros((b, s, h, self._hot_k.shape[-1]))
            self._sink_v = self._hot_k.new_zeros((b, s, h, self._v_dim))
        if run is not None:  # the usual case: a copy each, converting as it goes
            first, at, n = run
            self._sink_k[:, first : first + n].copy_(k[:, :, at : at + n].transpose(1, 2))
            self._sink_v[:, first : first + n].copy_(v[:, :, at : at + n].transpose(1, 2))
            return
        places = self._sink_places(lo, hi, start, self.device)
        if places is not None:
            rows, slots, t = places
            self._sink_k[rows, slots] = k[rows, :, t].to(self._sink_k.dtype)
            self._sink_v[rows, slots] = v[rows, :, t].to(self._sink_v.dtype)

    def _sink_run(self, lo: int, hi: int) -> tuple | None:
        """(first sink, its slot - ``lo``, how many) where every row's sinks at cache slots
        [lo, hi) are the same consecutive sinks at the same consecutive slots (a prompt
        without padding, or padded alike), else None. Asked alike by every layer of a forward:
        made once."""
        at = self._sink_slots

        def make() -> tuple | None:
            sel = (at >= lo) & (at < hi)
            picked = sel[0].nonzero().flatten()
            if not picked.numel() or not bool((sel == sel[0]).all()):
                return None
            first, n = int(picked[0]), picked.numel()
            slots = at[:, first : first + n]
            if not bool(sel[0, first : first + n].all()):
                return None  # the picked sinks are not consecutive
            if not bool((slots == slots[0, 0] + torch.arange(n)).all()):
                return None
            return first, int(slots[0, 0]) - lo, n

        return self._ctx.step.once("sink run", (lo, hi, *self._slots_key()), make)

    def _overwrite_sinks(
        self, k: torch.Tensor, v: torch.Tensor, lo: int, hi: int, base: int
    ) -> None:
        """Write the exact sinks at cache slots in [lo, hi) into ``k``/``v`` (in place), whose
        index 0 is cache slot ``base``."""
        if self._sink_slots is None or hi <= lo:
            return
        places = self._sink_places(lo, hi, base, self.device)
        if places is not None:
            rows, slots, t = places
            k[rows, :, t] = self._sink_k[rows, slots].to(k.dtype)
            v[rows, :, t] = self._sink_v[rows, slots].to(v.dtype)

    def _sink_places(self, lo: int, hi: int, base: int, device: torch.device) -> tuple | None:
        """The sinks at cache slots [lo, hi) as (rows, which sinks, slots - ``base``) on
        ``device``, or None. Asked alike by every layer of a forward (equal slots): made once
        per device, from the host's copy of the slots."""
        at = self._sink_slots

        def make() -> tuple | None:
            sel = (at >= lo) & (at < hi)
            if not bool(sel.any()):
                return None
            rows, slots = sel.nonzero(as_tuple=True)
            return tuple(i.to(device) for i in (rows, slots, at[rows, slots] - base))

        key = (lo, hi, base, *self._slots_key())
        return self._ctx.step.once(f"sink places on {device}", key, make)

    def _slots_key(self) -> tuple:
        """The sinks' slots as a memo's key (their values: another batch's slots differ)."""
        return tuple(self._sink_slots.shape), self._sink_slots.numpy().tobytes()

    def _sinks_in_blocks(self) -> torch.Tensor | None:
        """[B, S] bool: which sinks sit in a compressed block (their coded slot holds the block
        mean; attention over the codes reads them exact instead), or None."""
        if self._sink_slots is None:
            return None
        inside = self._sink_slots < self.compressed_length
        return inside.to(self.device) if bool(inside.any()) else None

    def _sink_mask(self, start: int, t: int) -> torch.Tensor | None:
        """[B, t] bool: which of cache slots start..start+t are sinks (held exact)."""
        if self._sink_slots is None:
            return None

        def make() -> torch.Tensor | None:
            places = self._sink_places(start, start + t, start, torch.device("cpu"))
            if places is None:
                return None
            rows, _, slots = places
            mask = torch.zeros((self._rows, t), dtype=torch.bool)
            mask[rows, slots] = True
            return mask

        key = (start, t, self._rows, *self._slots_key())
        return self._ctx.step.once("sink mask", key, make)


def pick_sink_slots(s: int, b: int, start: int, q: int, mask: torch.Tensor | None) -> tuple:
    """(host ``[b, s]`` cache slots of each row's sinks, past the last of them, ``mask``) for a
    forward of ``q`` tokens from slot ``start``: each row's first ``s`` real (unpadded) tokens
    where its 2-D attention mask is known, else the first slots."""
    idx = torch.arange(start, start + s).expand(b, s).clone()
    if mask is not None and mask.dim() == 2 and mask.shape == (b, start + q):
        new = mask[:, start:].bool().cpu()
        for r in range(b):
            real = new[r].nonzero().flatten()[:s]
            pad_after = torch.arange(q, q + s - real.numel())  # sinks still to come
            idx[r] = start + torch.cat([real, pad_after])
    return idx, int(idx.max()) + 1, mask
