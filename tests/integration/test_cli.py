"""The ``kakeyaturbo bench`` and ``capture`` commands on real captured K/V."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
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
        "import pathlib, sys\n"
        "sys.modules['torch'] = None\n"
        "pathlib.Path('m').mkdir(); pathlib.Path('m/config.json').write_text('{}')\n"
        "pathlib.Path('t').write_text('some text')\n"
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


# A new user's first contact: every error is one line on stderr naming the problem, exit status
# 2 for a usage error and 1 for a failure while running, no traceback without --debug, and no
# output file left behind.


def _cli(argv, cwd, timeout=300) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "kakeyaturbo", *map(str, argv)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return res, time.perf_counter() - t0


def _one_error_line(res: subprocess.CompletedProcess, rc: int) -> str:
    assert res.returncode == rc, res.stderr
    assert "Traceback" not in res.stderr
    # The error is the last line and the only one (the lines above it are progress bars).
    lines = res.stderr.strip().splitlines()
    assert [x for x in lines if "error" in x.lower()] == lines[-1:], res.stderr
    assert lines[-1].startswith("error: "), res.stderr
    return lines[-1]


def test_a_method_typo_is_a_usage_error_before_the_model_loads(model_dir, eval_text, tmp_path):
    """A misspelt method costs seconds, not a reference pass, and writes no results.json."""
    out = tmp_path / "results.json"
    argv = ["eval", "ppl", "--model", model_dir, "--text", eval_text, "--method", "kakeya"]
    res, seconds = _cli([*argv, "--method", "kakey", "--no-progress", "--out", out], tmp_path)
    line = _one_error_line(res, 2)
    assert line.startswith("error: --method 'kakey': unknown method 'kakey'; known: ")
    assert "kakeya" in line and line.endswith("(see kakeyaturbo eval ppl --help)")
    assert not out.exists()
    # Importing torch and the methods is all it does (the reference pass of 16 passages at
    # ctx 960 alone takes far longer).
    assert seconds < 60, seconds


def test_spec_checks_run_before_any_model_load(model_dir, eval_text, tmp_path, monkeypatch, capsys):
    import kakeyaturbo.eval.ppl
    import kakeyaturbo.modeling

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kakeyaturbo.modeling, "load_model", no_model)
    monkeypatch.setattr(kakeyaturbo.eval.ppl, "load_model", no_model)
    data = ["--model", str(model_dir), "--text", str(eval_text)]
    out = tmp_path / "r.json"
    for argv, want in [
        (["eval", "ppl", *data, "--method", "kakeya:bitz=3"], "--method 'kakeya:bitz=3': "),
        (["eval", "ppl", *data, "--method", "kivi:bits=x"], "--method 'kivi:bits=x': "),
        (["eval", "ppl", *data, "--method", "kakeya:calibration=nope"], "is not a calibration"),
        (["eval", "ppl", *data, "--method", "identity", "--copy", "--ctx", "8"], "--copy needs"),
        (["eval", "sweep", *data, "--family", "kivi:bits={bits}{x}"], "--family: "),
        (["eval", "sweep", *data, "--options", "bogus=1"], "--options: ['bogus']"),
        (["eval", "layers", *data, "--method", "nope"], "--method 'nope': unknown method"),
        (["eval", "bytes", *data, "--method", "nope"], "--method 'nope': unknown method"),
    ]:
        assert main([*argv, "--out", str(out)]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and want in err and err.count("\n") == 1, err
        assert not out.exists()


@pytest.mark.parametrize(
    "argv, want",
    [
        (
            ["eval", "ppl", "--model", "nope", "--text", "t.txt", "--method", "kakeya"],
            "argument --model: model 'nope' does not exist",
        ),
        (
            ["eval", "ppl", "--model", "m", "--text", "nope.txt", "--method", "kakeya"],
            "argument --text: text file 'nope.txt' does not exist",
        ),
        (
            ["eval", "ppl", "--model", "t.txt", "--text", "t.txt", "--method", "kakeya"],
            "model 't.txt' is a file but not a .gguf file",
        ),
        (
            ["eval", "ppl", "--model", ".", "--text", "t.txt", "--method", "kakeya"],
            "model '.' is not a Hugging Face model folder (no config.json)",
        ),
        (
            ["eval", "ppl", "--model", "m", "--text", "t.txt", "--method", "kakeya", "--ctx", "0"],
            "argument --ctx: must be >= 1, got 0",
        ),
        (["eval", "ppl", "--model", "m", "--text", "t.txt"], "arguments are required: --method"),
        (
            ["eval", "bytes", "--model", "m", "--text", "t.txt", "--fit-max", "-1"],
            "argument --fit-max: must be >= 1, got -1",
        ),
        (["eval", "held-out", "nope.json", "--chosen", "t.txt"], "result 'nope.json' does not"),
        (["report", "--results", "nope"], "results folder 'nope' does not exist"),
        (
            [
                "capture",
                "--model",
                "m",
                "--text",
                "t.txt",
                "--out",
                "o.safetensors",
                "--tokens",
                "x",
            ],
            "argument --tokens: expected a whole number, got 'x'",
        ),
        (
            ["calibrate", "--model", "m", "--text", "t.txt", "--out", "o", "--ridge", "0"],
            "argument --ridge: must be > 0, got 0",
        ),
        (["bench", "nope.npy"], "tensor file 'nope.npy' does not exist"),
        (["bench", "x.npy", "--bit-width", "5"], "bit_width must be 1, 2, 3, 4 or 8, got 5"),
        (["bench", "x.npy", "--dump-decoded", "y.txt"], "--dump-decoded 'y.txt': expected a .npy"),
        (["bench", "x.npy", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
        (["bench", "t.txt"], "t.txt: expected a .npy or .safetensors file"),
        (["bench", "s.safetensors"], "holds 2 tensors; pick one with --tensor"),
        (["bench", "s.safetensors", "--tensor", "c"], "has no tensor 'c'"),
        (["bogus"], "invalid choice: 'bogus'"),
    ],
)
def test_usage_errors_are_one_line_with_status_2(argv, want, tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "t.txt").write_text("some text")
    np.save(tmp_path / "x.npy", np.ones((2, 8, 4), np.float32))
    save_file(
        {"a": np.ones((8, 4), np.float32), "b": np.ones((8, 4), np.float32)},
        str(tmp_path / "s.safetensors"),
    )
    before = set(tmp_path.iterdir())
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's own errors exit
            rc = e.code
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and want in err, err
    assert "Traceback" not in err
    assert set(tmp_path.iterdir()) == before


def test_a_runtime_failure_is_one_line_with_status_1_and_writes_nothing(model_dir, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("Only a few words.")
    out = tmp_path / "kv.safetensors"
    argv = ["capture", "--model", model_dir, "--text", text, "--tokens", "64", "--out", out]
    res, _ = _cli(argv, tmp_path)
    line = _one_error_line(res, 1)
    assert "tokens available, 64 requested" in line
    assert line.endswith("(--debug shows the traceback)")
    assert not out.exists() and not list(tmp_path.glob(".kv*"))
    # --debug, anywhere on the line, lets the exception out (Python prints its traceback).
    with pytest.raises(ValueError, match="tokens available, 64 requested"):
        main([str(a) for a in [*argv[:2], "--debug", *argv[2:]]])
    assert not out.exists()


def test_eval_writes_no_results_when_a_method_fails(model_dir, eval_text, tmp_path, capsys):
    """A method that fails while it runs: exit status 1 and no results.json (no half result)."""
    from kakeyaturbo.eval.methods import METHOD_HELP, METHODS, Method

    class Failing(Method):
        name = "failing"

        def compress(self, x, layer, stream):
            raise RuntimeError("it broke")

    METHODS["failing"], METHOD_HELP["failing"] = Failing, "fails"
    out = tmp_path / "results.json"
    data = ["--model", str(model_dir), "--text", str(eval_text), "--ctx", "16", "--n-eval", "4"]
    try:
        rc = main(
            [
                "eval",
                "ppl",
                *data,
                "--passages",
                "1",
                "--no-progress",
                "--method",
                "identity",
                "--method",
                "failing",
                "--out",
                str(out),
            ]
        )
    finally:
        del METHODS["failing"], METHOD_HELP["failing"]
    err = capsys.readouterr().err
    assert rc == 1
    assert "failing" in err and "RuntimeError: it broke" in err
    assert f"1 of 2 methods failed: {out} not written" in err
    assert "Traceback" not in err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_run_sh_names_its_stages_and_ends_with_the_table_of_the_rule_eval_applies():
    """The main job's headers and summary: four stages, the default beside its peers in one
    run, and the table printed last with the verdicts explained by the thresholds `eval`
    applies (so the summary cannot drift from the rule)."""
    from kakeyaturbo.eval import metrics
    from kakeyaturbo.eval.summary import VERDICTS

    repo = Path(__file__).resolve().parents[2]
    run = (repo / "scripts" / "run.sh").read_text()
    assert "STAGES=4" in run
    assert all(f"\nstage {i} " in run for i in range(1, 5))
    assert 'echo "== [$1/$STAGES] $2' in run and "== summary" in run and "Skipped:" in run
    for peer in ("--family kakeya ", "kivi:bits=4", "turboquant:bits=4", "--family fp8"):
        assert peer in run, peer
    assert "--plot artifacts/pareto.png" in run
    assert "kakeyaturbo eval table artifacts/eval.json --mark kakeya" in run
    for name, dppl, top1 in (
        ("ACCEPT", metrics.ACCEPT_DPPL, metrics.ACCEPT_TOP1),
        ("MARGINAL", metrics.MARGINAL_DPPL, metrics.MARGINAL_TOP1),
    ):
        rule = f"{name}: |delta-ppl| <= {100 * dppl:g}% and top-1 >= {100 * top1:g}%"
        assert rule in VERDICTS, rule
    test = (repo / "scripts" / "test.sh").read_text()
    assert "about 15 minutes on 2 cores" in test and "--durations=15" in test
