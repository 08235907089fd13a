"""The ``kakeyaturbo bench`` and ``capture`` commands on real captured K/V."""

from __future__ import annotations

import json
import subprocess
import sys

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


def _python(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )


def test_help_and_bench_parser_import_no_torch(tmp_path):
    """`--help` and `bench`'s parser import only the chosen command's module, so they start fast
    and work on the base install (numpy, tqdm, safetensors); then bench runs."""
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((2, 64, 32), np.float32))
    res = _python(
        "import sys\n"
        "from kakeyaturbo.cli import build_parser, main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0\n"
        "build_parser('bench').parse_args(['bench', 'x.npy'])\n"
        "heavy = sorted({'torch', 'transformers'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
        "assert main(['bench', 'x.npy', '--repeats', '1']) == 0\n",
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout[res.stdout.index("{") :])["shape"] == [2, 64, 32]
    for name in ("bench", "capture", "calibrate", "eval", "report"):
        assert f"    {name}" in res.stdout


def test_commands_without_their_extra_name_it(tmp_path):
    """Without torch (a None entry in sys.modules blocks an import), the optional commands and
    kakeyaturbo.hf say which extra to install."""
    res = _python(
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from kakeyaturbo.cli import main\n"
        "data = ['--model', 'm', '--text', 't']\n"
        "assert main(['eval', 'ppl', *data, '--method', 'kakeya']) == 1\n"
        "assert main(['capture', *data, '--out', 'kv.safetensors']) == 1\n"
        "assert main(['calibrate', *data, '--out', 'calib']) == 1\n"
        "try:\n"
        "    import kakeyaturbo.hf\n"
        "except ImportError as e:\n"
        "    print(e, file=sys.stderr)\n",
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert lines == [
        "error: kakeyaturbo eval needs 'torch', which is not installed: "
        "pip install 'kakeyaturbo[eval]'",
        "error: kakeyaturbo capture needs 'torch', which is not installed: "
        "pip install 'kakeyaturbo[hf]'",
        "error: kakeyaturbo calibrate needs 'torch', which is not installed: "
        "pip install 'kakeyaturbo[hf]'",
        "kakeyaturbo.hf needs torch, which is not installed: pip install 'kakeyaturbo[hf]'",
    ]
