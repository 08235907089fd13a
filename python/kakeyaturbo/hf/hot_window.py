"""The hot window: a layer's newest tokens, held exact, token-major, with room to append.

A window holds ``length`` tokens in stores of ``capacity`` slots, token first:

    keys   [C, B, H, D]  in the hot dtype
    values [C, B, H, Dv] as held (the hot dtype, or int8 rows ``[.., D + 2]``)
    pos    [C, B]        int32 RoPE positions (pre-RoPE mode), or None

and hands them out as the views layers and attention read, ``[B, H, T, D]`` and ``[B, T]``.

Why token-major: the slots a forward's ``q`` new tokens fill are then one dense piece of each
store, laid out as the model makes its keys and values (``[B, q, H, D]`` before its transpose).
So every layer's new tokens go into their windows in one ``torch._foreach_copy_`` per kind,
which a GPU runs as one launch where the pieces are dense with equal strides; and the tail a
flush keeps is one dense piece of each store too. A decode step appending layer by layer
took four ops per layer (a copy of each window, the values' encoding): more than a third of
its cache's ops on SmolLM2.

Why room: appending in place instead of copying the window each step. Room is bytes held,
so a store is made with 1 to :data:`ROOM` slots spare (16 tokens: about 1% of what the cache
holds at 8k tokens) and grows by as much when full.

A store is never shortened or shifted in place: keeping a tail, selecting rows or growing
makes new stores, so views handed out earlier (a flush's spans, an attention's runs) keep
what they saw. Appending writes only slots past every view's end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

#: Newest tokens every layer keeps full precision (the hot window).
DEFAULT_RESIDUAL_LENGTH = 128

#: Most spare slots a store is made with (at least one).
ROOM = 16


def capacity(n: int) -> int:
    """Slots of a store made for ``n`` tokens: 1 to :data:`ROOM` more."""
    return (n // ROOM + 1) * ROOM


class HotWindow:
    """``length`` tokens in token-major stores (see the module docstring)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, pos: Any, length: int) -> None:
        self.keys_store, self.values_store, self.pos_store = keys, values, pos
        self.length = length

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None) -> HotWindow:
        """A window holding copies of ``k`` ``[B, H, n, D]`` and ``v`` ``[B, H, n, Dv]``, both
        in the dtypes it holds them in, and ``pos`` ``[B, n]`` or None."""
        n = k.shape[-2]
        parts = (_token_major(k), _token_major(v), None if pos is None else pos.t())
        win = cls(*_stores(parts, capacity(n)), n)
        _copy_kinds([win], [(0, n)], [parts])
        return win

    @property
    def keys(self) -> torch.Tensor:
        """``[B, H, T, D]`` (a view)."""
        return self.keys_store[: self.length].permute(1, 2, 0, 3)

    @property
    def values(self) -> torch.Tensor:
        """``[B, H, T, Dv]`` as held (a view)."""
        return self.values_store[: self.length].permute(1, 2, 0, 3)

    @property
    def positions(self) -> torch.Tensor | None:
        """``[B, T]`` int32 (a view), or None."""
        return None if self.pos_store is None else self.pos_store[: self.length].t()

    def room(self) -> int:
        """Slots a forward may append into in place: none where the stores were made in
        inference mode and it is off now (torch refuses writes to them then)."""
        if self.keys_store.is_inference() and not torch.is_inference_mode_enabled():
            return 0
        return self.keys_store.shape[0] - self.length

    def stores(self) -> tuple:
        """The stores, keys, values, positions (None where it holds none)."""
        return self.keys_store, self.values_store, self.pos_store

    def select_rows(self, rows: torch.Tensor) -> HotWindow:
        """A window of batch rows ``rows`` (a 1-D long tensor on the stores' device), with the
        same room."""
        picked = [None if s is None else s.index_select(1, rows) for s in self.stores()]
        return HotWindow(*picked, self.length)


def append_together(
    items: Sequence[tuple[HotWindow, torch.Tensor, torch.Tensor, torch.Tensor | None]],
    encode: Callable[..., torch.Tensor] | None = None,
) -> None:
    """Append to each window its forward's new tokens, ``(window, k, v, pos)``: ``k`` ``[B, H,
    q, D]`` and ``v`` ``[B, H, q, Dv]`` as the model gave them (cast as they are copied),
    ``pos`` ``[B, q]`` where the window holds positions, else None. ``encode(values, out=)``
    makes the rows the windows hold from values ``[..., Dv]`` (``int8_rows.encode``), in one
    call for all the windows' values of a shape; None: the values are held as they are. A
    window without room grows first (one copy per kind for all)."""
    if not items:
        return
    if any((pos is None) != (w.pos_store is None) for w, _, _, pos in items):
        raise ValueError("a hot window holding positions takes them with its tokens, and only then")
    short = [(w, w.length + k.shape[-2]) for w, k, _, _ in items if w.room() < k.shape[-2]]
    if short:
        _grow(short)
    windows = [w for w, _, _, _ in items]
    spans = [(w.length, w.length + k.shape[-2]) for w, k, _, _ in items]
    values = [_token_major(v) for _, _, v, _ in items]
    if encode is not None:
        slots = [w.values_store[lo:hi] for w, (lo, hi) in zip(windows, spans)]
        values = _encoded(values, encode, slots)
    parts = [
        (_token_major(k), held, None if pos is None else pos.t())
        for (_, k, _, pos), held in zip(items, values)
    ]
    _copy_kinds(windows, spans, parts)
    for w, (_, hi) in zip(windows, spans):
        w.length = hi


def keep_together(items: Sequence[tuple[HotWindow, int, int]]) -> list[HotWindow]:
    """New windows holding tokens ``lo..hi`` of each ``(window, lo, hi)``: one copy per kind
    for all of them (a flush's layers keep their tails so)."""
    parts = [[None if s is None else s[lo:hi] for s in w.stores()] for w, lo, hi in items]
    made = [
        HotWindow(*_stores(p, capacity(hi - lo)), hi - lo) for p, (_, lo, hi) in zip(parts, items)
    ]
    _copy_kinds(made, [(0, w.length) for w in made], parts)
    return made


def _grow(short: Sequence[tuple[HotWindow, int]]) -> None:
    """Give each window new stores with room for ``need`` tokens, its tokens copied over."""
    olds = [[None if s is None else s[: w.length] for s in w.stores()] for w, _ in short]
    for (w, need), old in zip(short, olds):
        w.keys_store, w.values_store, w.pos_store = _stores(old, capacity(need))
    _copy_kinds([w for w, _ in short], [(0, w.length) for w, _ in short], olds)


def _stores(parts: Sequence[Any], slots: int) -> tuple:
    """Empty stores of ``slots`` tokens shaped and typed as the token-major ``parts`` (None
    stays None)."""
    return tuple(None if p is None else p.new_empty((slots, *p.shape[1:])) for p in parts)


def _copy_kinds(windows: Sequence[HotWindow], spans: Sequence[tuple[int, int]], parts) -> None:
    """Copy each window's token-major ``parts`` (keys, values, positions) into its slots
    ``lo..hi``: one ``_foreach_copy_`` per kind."""
    for kind in range(3):
        dsts, srcs = [], []
        for w, (lo, hi), part in zip(windows, spans, parts):
            store = w.stores()[kind]
            if store is not None and hi > lo and part[kind] is not None:
                dsts.append(store[lo:hi])
                srcs.append(part[kind])
        if dsts:
            torch._foreach_copy_(dsts, srcs)


def _encoded(values: list[torch.Tensor], encode: Callable, slots: list[torch.Tensor]) -> list:
    """``encode`` of each of ``values``: stacked where several are alike (one call per shape,
    their rows to be copied into ``slots``), else written into its slot (None: nothing left
    to copy)."""
    out: list[Any] = [None] * len(values)
    alike: dict[tuple, list[int]] = {}
    for i, v in enumerate(values):
        alike.setdefault((tuple(v.shape), v.dtype, v.device), []).append(i)
    for at in alike.values():
        if len(at) == 1:
            encode(values[at[0]], out=slots[at[0]])
            continue
        rows = encode(torch.stack([values[i] for i in at]))
        for j, i in enumerate(at):
            out[i] = rows[j]
    return out


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, n, D]`` -> ``[n, B, H, D]`` (a view)."""
    return x.permute(2, 0, 1, 3)


def launches(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> int:
    """Kernels a GPU runs for ``torch._foreach_copy_(dsts, srcs)``: one where CUDA's fast route
    takes the lists (torch's ``ForeachUtils.h``: one device, one dtype per list, every tensor
    dense and non-overlapping, each pair of equal sizes and of equal strides but where a size
    is 1), else a copy per pair."""
    if not dsts:
        return 0
    pairs = list(zip(dsts, srcs))
    fast = (
        len({t.device for t in (*dsts, *srcs)}) == 1
        and len({t.dtype for t in dsts}) == 1
        and len({t.dtype for t in srcs}) == 1
        and all(_dense(d) and _dense(s) and _alike(d, s) for d, s in pairs)
    )
    return 1 if fast else len(pairs)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its memory without gaps or overlaps (a permuted contiguous tensor)."""
    spans = sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1)
    step = 1
    for stride, size in spans:
        if stride != step:
            return False
        step *= size
    return True


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal sizes, and equal strides but where a size is 1."""
    return a.shape == b.shape and all(
        size == 1 or sa == sb for size, sa, sb in zip(a.shape, a.stride(), b.stride())
    )
