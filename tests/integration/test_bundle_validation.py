"""A calibration bundle is checked in full when it loads: a corrupted copy of a real bundle
(tensors damaged, swapped, missing or of another dtype or shape; metadata deleted, mistyped,
wrong, truncated or not UTF-8; safetensors unreadable) is a CalibrationError naming the
bundle's file and the field, never a bundle that loads and gives wrong logits."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from kakeyaturbo.calibration import Calibration, CalibrationError

META, TENSORS = "calibration.json", "tensors.safetensors"
SQUARE = ("q_second_moment", "k_whiten", "k_transform", "k_inverse", "k_pca", "v_transform")
MATRICES = SQUARE + ("k_joint", "v_joint")
VARIANCES = ("k_variances", "v_variances")
INT_FIELDS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
)


@pytest.fixture(scope="module")
def good(joint_bundle):
    """The fitted bundle's tensors and metadata, as saved."""
    from safetensors.numpy import load_file

    return (
        joint_bundle,
        load_file(str(joint_bundle / TENSORS)),
        json.loads((joint_bundle / META).read_text()),
    )


@pytest.fixture(scope="module")
def value_metric_bundle(model_and_tok, calib_text, tmp_path_factory):
    """A bundle with an output-weighted value frame: v_transform is not a rotation and the
    bundle holds its inverse."""
    from kakeyaturbo.calibration import calibrate

    model, tok = model_and_tok
    calib = calibrate(model, tok, calib_text, tokens=1024, progress=False, value_metric="output")
    return calib.save(tmp_path_factory.mktemp("vm") / "bundle")


def _write(tmp: Path, src: Path, tensors=None, meta=None, meta_bytes=None, tensor_bytes=None):
    from safetensors.numpy import save_file

    tmp.mkdir(parents=True, exist_ok=True)
    if tensor_bytes is not None:
        (tmp / TENSORS).write_bytes(tensor_bytes)
    elif tensors is not None:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / TENSORS))
    else:
        shutil.copy(src / TENSORS, tmp / TENSORS)
    if meta_bytes is not None:
        (tmp / META).write_bytes(meta_bytes)
    elif meta is not None:
        (tmp / META).write_text(json.dumps(meta))
    else:
        shutil.copy(src / META, tmp / META)
    return tmp


def _refused(path: Path, file: str, *fields: str) -> str:
    with pytest.raises(CalibrationError) as err:
        Calibration.load(path)
    msg = str(err.value)
    assert str(path / file) in msg, msg
    assert any(f in msg for f in fields), msg
    return msg


def test_fitted_bundles_load_with_the_tensors_saved(joint_bundle, good, value_metric_bundle):
    _, tensors, meta = good
    loaded = Calibration.load(joint_bundle)
    assert loaded.joint_heads and set(loaded.tensors) == set(tensors)
    for name, arr in tensors.items():
        np.testing.assert_array_equal(loaded.tensors[name], arr)
    assert loaded.fingerprint == meta["fingerprint"]
    loaded._check_tensors()  # the in-memory check agrees
    vm = Calibration.load(value_metric_bundle)
    assert "v_inverse" in vm.tensors and vm.meta["value_metric"] == "output"


def test_a_checked_bundle_codes_as_before(joint_bundle, model_and_tok, real_kv):
    """Loading checks and does not change what the bundle codes: the transforms of the
    loaded bundle are those of its tensors, and round-trip real keys and values."""
    import torch

    from kakeyaturbo.calibration import KVTransforms

    loaded = Calibration.load(joint_bundle, model_and_tok[0])
    raw = Calibration(loaded.fingerprint, dict(loaded.tensors), loaded.meta)
    for layer in range(loaded.num_layers):
        for stream in ("k_pre_rope", "v"):
            x = torch.from_numpy(real_kv[f"layer{layer}.{stream}"])[None]
            a = KVTransforms(loaded).forward(x, layer, stream[0])
            assert torch.equal(a, KVTransforms(raw).forward(x, layer, stream[0]))
            back = KVTransforms(loaded).inverse(a, layer, stream[0])
            torch.testing.assert_close(back, x, rtol=1e-4, atol=1e-4 * float(x.abs().max()))


def _damage(kind: str, name: str, t: dict) -> None:
    """Damages tensor ``name`` of ``t`` in place."""
    m = t[name]
    if kind == "x1e30":
        t[name] = m * np.float32(1e30)
    elif kind == "zeroed":
        t[name] = np.zeros_like(m)
    elif kind == "nan":
        m = m.copy()
        m.reshape(-1)[m.size // 3] = np.nan
        t[name] = m
    elif kind == "inf":
        m = m.copy()
        m.reshape(-1)[-1] = -np.inf
        t[name] = m
    elif kind in ("float16", "float64", "int32"):
        t[name] = m.astype(kind)
    elif kind == "fewer layers":
        t[name] = m[:-1]
    elif kind == "one head":
        t[name] = m[:, :1]
    elif kind == "missing":
        del t[name]
    elif kind == "perturbed":  # one entry moved by 5% of the largest
        m = m.copy()
        m[(1, 0, 5, 3) if m.ndim == 4 else (1, 5, 3)] += 0.05 * np.abs(m).max()
        t[name] = m
    elif kind == "scaled x1.01":
        t[name] = m * np.float32(1.01)
    elif kind == "scaled x2":
        t[name] = m * np.float32(2)
    elif kind == "layers swapped":
        t[name] = m[[1, 0, *range(2, len(m))]]
    else:
        raise AssertionError(kind)


TENSOR_CASES = [
    *[(k, n) for k in ("x1e30", "zeroed", "perturbed", "scaled x1.01") for n in MATRICES],
    *[(k, n) for k in ("nan", "inf", "float16", "fewer layers", "missing") for n in MATRICES],
    *[(k, n) for k in ("nan", "inf", "float16", "fewer layers", "missing") for n in VARIANCES],
    *[("one head", n) for n in SQUARE + VARIANCES],
    *[(k, n) for k in ("float64", "int32") for n in ("k_transform", "v_variances")],
    *[("scaled x2", n) for n in ("q_second_moment", "k_whiten", "k_transform", "k_inverse")],
    *[("layers swapped", n) for n in ("q_second_moment", "k_whiten", "k_transform", "k_inverse")],
]


@pytest.mark.parametrize("kind,name", TENSOR_CASES, ids=[f"{n}-{k}" for k, n in TENSOR_CASES])
def test_a_damaged_tensor_is_refused(good, tmp_path, kind, name):
    src, tensors, _ = good
    t = dict(tensors)
    _damage(kind, name, t)
    _refused(_write(tmp_path / "b", src, tensors=t), TENSORS, name)


# k_pca and v_transform are both rotations fitted on data the bundle does not hold: swapped,
# they load (and decode exactly, in a frame that suits the values less).
SWAPS = [p for p in itertools.combinations(SQUARE, 2) if p != ("k_pca", "v_transform")]


@pytest.mark.parametrize("a,b", SWAPS)
def test_swapped_tensors_are_refused(good, tmp_path, a, b):
    src, tensors, _ = good
    t = dict(tensors)
    t[a], t[b] = t[b], t[a]
    _refused(_write(tmp_path / "b", src, tensors=t), TENSORS, a, b)


def test_variances_out_of_order_or_negative_are_refused(good, tmp_path):
    src, tensors, _ = good
    for name in VARIANCES:
        for damage in ("ascending", "negative"):
            t = dict(tensors)
            t[name] = t[name][..., ::-1] if damage == "ascending" else t[name] - t[name].max()
            _refused(_write(tmp_path / f"{name}-{damage}", src, tensors=t), TENSORS, name)


def test_unknown_tensors_and_unpaired_joint_frames_are_refused(good, tmp_path):
    src, tensors, _ = good
    t = dict(tensors, v_invrse=tensors["v_transform"])
    _refused(_write(tmp_path / "extra", src, tensors=t), TENSORS, "v_invrse")
    t = {k: v for k, v in tensors.items() if not k.endswith("_joint")}
    _refused(_write(tmp_path / "nojoint", src, tensors=t), TENSORS, "joint_heads")


@pytest.mark.parametrize("kind", ["missing", "x1e30", "zeroed", "perturbed", "transposed"])
def test_a_damaged_value_inverse_is_refused(value_metric_bundle, tmp_path, kind):
    from safetensors.numpy import load_file

    t = load_file(str(value_metric_bundle / TENSORS))
    if kind == "transposed":  # what a bundle with an orthonormal value frame would use
        t["v_inverse"] = np.ascontiguousarray(np.swapaxes(t["v_transform"], -1, -2))
    else:
        _damage(kind, "v_inverse", t)
    _refused(_write(tmp_path / "b", value_metric_bundle, tensors=t), TENSORS, "v_inverse")


def _set(meta: dict, field: str, value) -> dict:
    """A copy of ``meta`` with dotted ``field`` set (``DELETE``: removed)."""
    meta = json.loads(json.dumps(meta))
    *parents, last = field.split(".")
    at = meta
    for p in parents:
        at = at[p]
    if value is DELETE:
        del at[last]
    else:
        at[last] = value
    return meta


DELETE = object()
SENSITIVITY = {"mode": "both", "offsets": {"k": [0.1] * 6, "v": [-0.1] * 6}}
META_CASES = [
    ("version", DELETE),
    ("version", True),
    ("version", "1"),
    ("version", 1.0),
    ("version", 2),
    ("fingerprint", DELETE),
    ("fingerprint", []),
    ("fingerprint.model_type", DELETE),
    ("fingerprint.model_type", 3),
    ("fingerprint.model_type", ""),
    *[(f"fingerprint.{k}", DELETE) for k in INT_FIELDS],
    *[(f"fingerprint.{k}", v) for k in INT_FIELDS for v in (True, "6", 6.0, None, 0, -2, [6])],
    ("fingerprint.num_attention_heads", 3),
    ("fingerprint.k_proj0_probe", [0.5] * 63),
    ("fingerprint.qkv_probe", [0.5] * 287),
    ("fingerprint.k_proj0_probe", "0.5"),
    ("fingerprint.k_proj0_probe", [0.5] * 63 + ["x"]),
    ("fingerprint.k_proj0_probe", [0.5] * 63 + [float("nan")]),
    ("fingerprint.k_proj0_probe", [0.5] * 63 + [True]),
    ("fingerprint.k_proj0_sha256", 12),
    ("fingerprint.extra", 1),
    ("tokens", "2048"),
    ("tokens", True),
    ("tokens", -1),
    ("ctx", 1024.5),
    ("ridge", "0.001"),
    ("ridge", -1.0),
    ("ridge", float("nan")),
    ("ridge", 0.5),
    ("text_file", 7),
    ("text_sha256", "xyz"),
    ("value_metric", 1),
    ("value_metric", "none"),  # the bundle holds v_inverse
    ("value_metric", "scaled"),
    ("joint_heads", 1),
    ("joint_heads", "true"),
    ("joint_heads", False),
    ("command", ["calibrate"]),
    ("unknown_field", 1),
    ("sensitivity", []),
    ("sensitivity", {"mode": "both"}),
    ("sensitivity", dict(SENSITIVITY, offsets={"k": [0.1] * 6})),
    ("sensitivity", dict(SENSITIVITY, offsets={"k": [0.1] * 5, "v": [0.1] * 6})),
    ("sensitivity", dict(SENSITIVITY, offsets={"k": ["a"] * 6, "v": [0.1] * 6})),
    ("sensitivity", dict(SENSITIVITY, offsets=[0.1] * 12)),
    ("sensitivity", dict(SENSITIVITY, mode=3)),
    ("sensitivity", dict(SENSITIVITY, kl_by_mode={"snapshot": [1.0]})),
    ("sensitivity", dict(SENSITIVITY, surprise=1)),
]


@pytest.mark.parametrize(
    "field,value",
    META_CASES,
    ids=[f"{f}={'deleted' if v is DELETE else v!r}" for f, v in META_CASES],
)
def test_bad_metadata_is_refused(good, tmp_path, field, value):
    src, _, meta = good
    path = _write(tmp_path / "b", src, meta=_set(meta, field, value))
    named = field.split(".")[-1] if field != "version" else "version"
    with pytest.raises(CalibrationError) as err:
        Calibration.load(path)
    msg = str(err.value)
    assert str(path) in msg and (META in msg or TENSORS in msg), msg
    assert named in msg, msg


def test_geometry_that_disagrees_with_the_tensors_is_refused(good, tmp_path):
    src, _, meta = good
    for field, value in (("num_hidden_layers", 7), ("num_key_value_heads", 1), ("head_dim", 32)):
        path = _write(tmp_path / field, src, meta=_set(meta, f"fingerprint.{field}", value))
        msg = _refused(path, TENSORS, "has shape")
        assert field in msg


def test_a_valid_sensitivity_scan_loads(good, tmp_path):
    src, _, meta = good
    scan = dict(SENSITIVITY, kl={"k": [1.0] * 6, "v": [2.0] * 6}, probe_bits=2, passages=4)
    path = _write(tmp_path / "b", src, meta=_set(meta, "sensitivity", scan))
    assert Calibration.load(path).layer_bit_offsets("k") == [0.1] * 6


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{",
        b"[1, 2]",
        b"null",
        b'"calibration"',
        b"\xff\xfe{}",
        json.dumps({"version": 1}).encode("utf-16"),
        b"[" * 100_000,
    ],
    ids=["empty", "truncated", "array", "null", "string", "not-utf8", "utf16", "nested"],
)
def test_unreadable_metadata_is_refused(good, tmp_path, content):
    src = good[0]
    _refused(_write(tmp_path / "b", src, meta_bytes=content), META, "JSON", "UTF-8", "version")


def test_truncated_metadata_is_refused_at_every_cut(good, tmp_path):
    src = good[0]
    raw = (src / META).read_bytes()
    for cut in range(1, len(raw) - 2, max(1, len(raw) // 40)):
        path = _write(tmp_path / str(cut), src, meta_bytes=raw[:cut])
        _refused(path, META, "JSON")


@pytest.mark.parametrize(
    "damage", ["empty", "truncated", "half", "garbage", "huge header", "bad header json", "tail"]
)
def test_unreadable_safetensors_are_refused(good, tmp_path, damage):
    src = good[0]
    raw = (src / TENSORS).read_bytes()
    content = {
        "empty": b"",
        "truncated": raw[:5],
        "half": raw[: len(raw) // 2],
        "garbage": bytes(range(256)) * 16,
        "huge header": (2**62).to_bytes(8, "little") + raw[8:],
        "bad header json": raw[:8]
        + b"!" * (int.from_bytes(raw[:8], "little"))
        + raw[8:][int.from_bytes(raw[:8], "little") :],
        "tail": raw[:-7],
    }[damage]
    _refused(_write(tmp_path / "b", src, tensor_bytes=content), TENSORS, "safetensors")


def test_missing_files_are_refused(good, tmp_path):
    src = good[0]
    for missing in (META, TENSORS):
        path = _write(tmp_path / missing, src)
        (path / missing).unlink()
        with pytest.raises(CalibrationError, match="not a calibration bundle"):
            Calibration.load(path)
