"""The ``kakeya`` serde as LMCache takes it: a :class:`Serializer` / :class:`Deserializer`
pair over LMCache memory objects, and the factory its L2 adapter configs name."""

from __future__ import annotations

from typing import Any

import torch
from lmcache.v1.distributed.serde import AsyncSerdeProcessor, Deserializer, Serializer

from ..calibration import Calibration
from ..hf.rope import RotarySpec
from ..pipeline import Pipeline
from ..recipes import default_recipe
from .chunk_codec import ChunkCodec, Geometry
from .options import SerdeOptions

SERDE_NAME = "kakeya"


def _rope(opts: SerdeOptions):
    if opts.model is not None:
        from transformers import AutoConfig

        from ..hf.rope import ModelRope

        return ModelRope(AutoConfig.from_pretrained(opts.model))
    d = opts.head_dim
    inv = 1.0 / (float(opts.rope_theta) ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    spec = RotarySpec(inv_freq=inv.float(), rot_dim=d)
    return lambda layer: spec


def build_codec(opts: SerdeOptions) -> ChunkCodec:
    calib = Calibration.load(opts.bundle)
    fp = calib.fingerprint
    want = {
        "num_hidden_layers": opts.num_layers,
        "num_key_value_heads": opts.num_kv_heads,
        "head_dim": opts.head_dim,
    }
    wrong = {k: (fp.get(k), v) for k, v in want.items() if k in fp and int(fp[k]) != v}
    if wrong:
        raise ValueError(f"kakeya serde: bundle {opts.bundle} is for another model: {wrong}")
    recipe = default_recipe(calib)
    if opts.bits != recipe.k.bits_per_value:
        recipe = recipe.replace(
            k=recipe.k.replace(bits_per_value=opts.bits),
            v=recipe.v.replace(bits_per_value=opts.bits),
        )
    pipeline = Pipeline(recipe, calib, _rope(opts))
    geometry = Geometry(opts.num_layers, opts.num_kv_heads, opts.head_dim)
    return ChunkCodec(pipeline, geometry, opts.chunk_size, opts.max_positions, opts.budget_bits)


def _tensor(obj: Any, what: str) -> torch.Tensor:
    t = getattr(obj, "tensor", None)
    if t is None:
        raise ValueError(f"kakeya serde: the {what} memory object has no tensor")
    return t


def _kv(obj: Any) -> torch.Tensor:
    """The chunk as ``[2, layers, tokens, hidden]`` (LMCache's KV layout)."""
    t = _tensor(obj, "KV")
    return t if t.dim() == 4 else t.reshape(obj.get_shapes()[0])


class KakeyaSerializer(Serializer):
    def __init__(self, codec: ChunkCodec) -> None:
        self.codec = codec

    def serialize(self, src: Any, dst: Any, key: Any) -> int:
        data = self.codec.encode(_kv(src))
        out = _tensor(dst, "destination").view(torch.uint8).reshape(-1)
        if len(data) > out.numel():
            raise ValueError(f"kakeya serde: {len(data)} bytes for a {out.numel()}-byte buffer")
        out[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return len(data)

    def estimate_serialized_size(self, layout_desc: Any) -> int:
        if len(layout_desc.shapes) != 1:
            raise ValueError(f"kakeya serde: takes one KV group, got {len(layout_desc.shapes)}")
        return self.codec.size_bound(tuple(layout_desc.shapes[0]), layout_desc.dtypes[0])


class KakeyaDeserializer(Deserializer):
    def __init__(self, codec: ChunkCodec) -> None:
        self.codec = codec

    def deserialize(self, src: Any, dst: Any, key: Any) -> None:
        raw = _tensor(src, "source").view(torch.uint8).reshape(-1)
        self.codec.decode(memoryview(raw.numpy()), _kv(dst))


def create_kakeya_serde(kwargs: dict[str, object]) -> AsyncSerdeProcessor:
    """LMCache's serde factory: ``kwargs`` is the adapter's ``"serde"`` dict less ``type``."""
    opts = SerdeOptions.from_kwargs(dict(kwargs))
    codec = build_codec(opts)
    return AsyncSerdeProcessor(
        KakeyaSerializer(codec), KakeyaDeserializer(codec), max_workers=opts.max_workers
    )
