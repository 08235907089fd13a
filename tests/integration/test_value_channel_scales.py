"""Values weighted per channel by what the output projection reads of them (the default bundle,
``value_metric="channel"``): a value channel scaled up 100x against ``o_proj`` (a function-
preserving rescale, what biases and massive activations look like to the cache) is coded as
the original channel was, not given the bits of a channel 100x the others."""

import numpy as np
import pytest
import torch

from kakeyaturbo.calibration import Calibration, calibrate
from kakeyaturbo.calibration.fit import value_channel_scales
from kakeyaturbo.calibration.transforms import KVTransforms
from kakeyaturbo.eval.outlier_channels import with_outlier_channels
from kakeyaturbo.pipeline import Pipeline
from kakeyaturbo.recipes import default_recipe

CHANNEL, FACTOR = 5, 100.0


@pytest.fixture(scope="module")
def skewed(model_and_tok):
    model, _ = model_and_tok
    return with_outlier_channels(model, value_channel=CHANNEL, factor=FACTOR)


def _coded(model, tok, calib_text, metric: str, x: torch.Tensor, layer: int):
    calib = calibrate(model, tok, calib_text, tokens=2048, progress=False, value_metric=metric)
    y, blocks = Pipeline(default_recipe(calib), calib).roundtrip(x, layer, "v")
    return y, sum(b.nbytes for b in blocks)


def test_a_rescaled_channel_gets_the_inverse_weight(model_and_tok, skewed):
    s, t = value_channel_scales(model_and_tok[0]), value_channel_scales(skewed)
    assert s.shape == (len(model_and_tok[0].model.layers), s.shape[1], 64)
    np.testing.assert_allclose(s.mean(-1), 1.0, atol=0.25)  # relative to the head's channels
    # Channel 5 read 100x less: its weight / 100; the others move by the mean's change only.
    ratio = t / s
    np.testing.assert_allclose(
        ratio[..., CHANNEL] * FACTOR, ratio[..., :CHANNEL].mean(-1), rtol=1e-3
    )
    others = ratio[..., CHANNEL + 1 :]
    np.testing.assert_allclose(others, np.broadcast_to(ratio[..., :1], others.shape), rtol=1e-6)


def test_the_bundle_codes_values_in_the_weighted_frame(
    model_and_tok, calib_text, real_kv, tmp_path
):
    model, tok = model_and_tok
    calib = calibrate(model, tok, calib_text, tokens=1024, progress=False)
    loaded = Calibration.load(calib.save(tmp_path), model)
    assert loaded.meta["value_metric"] == "channel" and loaded.meta["joint_heads"]
    s = value_channel_scales(model)
    tv, inv = (loaded.tensors[n].astype(np.float64) for n in ("v_transform", "v_inverse"))
    # diag(s) @ U: the rows over s are orthonormal, the inverse is U^T diag(1/s).
    u = tv / s[..., :, None]
    np.testing.assert_allclose(
        np.swapaxes(u, -1, -2) @ u, np.broadcast_to(np.eye(64), u.shape), atol=1e-5
    )
    np.testing.assert_allclose(tv @ inv, np.broadcast_to(np.eye(64), tv.shape), atol=1e-4)
    t = KVTransforms(loaded)
    x = torch.from_numpy(real_kv["layer1.v"])[None]
    back = t.inverse(t.forward(x, 1, "v"), 1, "v")
    torch.testing.assert_close(back, x, rtol=1e-4, atol=1e-4 * float(x.abs().max()))


def test_a_value_channel_100x_against_o_proj_is_coded_as_the_original(
    model_and_tok, skewed, calib_text, real_kv
):
    model, tok = model_and_tok
    layer = 1
    x = torch.from_numpy(real_kv[f"layer{layer}.v"])[None]
    x_skewed = x.clone()
    x_skewed[..., CHANNEL] *= FACTOR
    unskew = torch.ones(64)
    unskew[CHANNEL] = 1 / FACTOR
    rest = [c for c in range(64) if c != CHANNEL]

    def errors(metric):
        """(relative error of the other channels, of channel 5; bytes) of the original model's
        values and of the skewed model's, the latter read back at the original's scale."""
        out = []
        for m, v, back in ((model, x, 1.0), (skewed, x_skewed, unskew)):
            y, nbytes = _coded(m, tok, calib_text, metric, v, layer)
            e = y * back - x
            out.append(
                (
                    float(e[..., rest].norm() / x[..., rest].norm()),
                    float(e[..., CHANNEL].norm() / x[..., CHANNEL].norm()),
                    nbytes,
                )
            )
        return out

    # Coded as the original was: the same bytes, the same accuracy on every channel (not the
    # same codes: the frames' near-equal variances rotate with float rounding).
    (rest_err, channel_err, nbytes), (rest_skewed, channel_skewed, nbytes_skewed) = errors(
        "channel"
    )
    assert abs(nbytes_skewed - nbytes) <= 0.01 * nbytes, (nbytes, nbytes_skewed)
    assert rest_skewed <= 1.03 * rest_err, (rest_err, rest_skewed)
    assert channel_skewed <= 1.1 * channel_err, (channel_err, channel_skewed)
    # Without the weights the channel takes the other channels' bits.
    (rest_none, *_), (rest_none_skewed, *_) = errors("none")
    assert rest_none_skewed > 1.3 * rest_none, (rest_none, rest_none_skewed)
