"""The ``kakeyaturbo bench`` and ``capture`` commands on real captured K/V."""

from __future__ import annotations

import json

import numpy as np
from safetensors.numpy import load_file, save_file

from kakeyaturbo.cli import main


def test_bench_reports_json_and_dumps_reconstruction(real_kv, tmp_path, capsys):
    src = tmp_path / "kv.safetensors"
    save_file({"k": real_kv["layer2.k"], "v": real_kv["layer2.v"]}, str(src))
    dump = tmp_path / "dec.npy"
    rc = main(
        [
            "bench",
            str(src),
            "--tensor",
            "k",
            "--bit-width",
            "4",
            "--k",
            "0",
            "--stages",
            "--dump-decoded",
            str(dump),
            "--repeats",
            "1",
        ]
    )
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    x = real_kv["layer2.k"]
    y = np.load(dump)
    assert y.shape == x.shape
    rel = np.linalg.norm(x - y) / np.linalg.norm(x)
    assert abs(rel - rep["relative_error"]) < 1e-6
    assert rep["params"]["bit_width"] == 4 and rep["params"]["k"] == 0
    assert rep["bf16_bytes"] == x.size * 2
    assert abs(rep["ratio_vs_bf16"] - rep["bf16_bytes"] / rep["stored_bytes"]) < 1e-12
    assert rep["stages"]["full"] <= rep["stages"]["quantised"] + 1e-9
    assert abs(rep["stages"]["full"] - rel) < 0.01


def test_capture_writes_pre_and_post_rope_keys(model_dir, eval_text, tmp_path, capsys):
    out = tmp_path / "cap.safetensors"
    assert (
        main(
            [
                "capture",
                "--model",
                str(model_dir),
                "--text",
                str(eval_text),
                "--tokens",
                "64",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    t = load_file(str(out))
    assert set(t) == {f"layer{i}.{s}" for i in range(6) for s in ("k", "k_pre_rope", "v")}
    assert t["layer0.k"].shape == (2, 64, 64)
    # Position 0 has rotation angle 0: pre- and post-RoPE keys agree there, not later.
    np.testing.assert_allclose(t["layer0.k"][:, 0], t["layer0.k_pre_rope"][:, 0], atol=1e-5)
    assert not np.allclose(t["layer0.k"][:, 5], t["layer0.k_pre_rope"][:, 5], atol=1e-3)
