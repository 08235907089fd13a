"""The `eval` and `report` commands end to end on the real model, tiny settings."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from kakeyaturbo.eval.cli import main, register

ROW_KEYS = {
    "method",
    "params",
    "delta_ppl",
    "top1",
    "kl",
    "verdict",
    "stored_bytes",
    "bf16_bytes",
    "ratio",
}


@pytest.fixture(scope="module")
def data(model_dir, eval_text):
    return [
        "--model",
        str(model_dir),
        "--text",
        str(eval_text),
        "--ctx",
        "64",
        "--n-eval",
        "8",
        "--passages",
        "2",
    ]


def test_ppl_writes_the_documented_json(tmp_path, data):
    out = tmp_path / "results.json"
    argv = ["eval", "ppl", *data, "--no-progress", "--out", str(out)]
    for spec in ("identity", "zero:streams=v", "kivi:bits=2", "hf-hqq:bits=3"):
        argv += ["--method", spec]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "ppl" and res["command"].startswith("kakeyaturbo eval ppl ")
    assert (res["ctx"], res["n_eval"], res["passages"]) == (64, 8, 2)
    rows = {r["method"]: r for r in res["methods"]}
    assert list(rows) == ["identity", "zero:streams=v", "kivi:bits=2", "hf-hqq:bits=3"]
    for spec in ("identity", "zero:streams=v", "kivi:bits=2"):
        r = rows[spec]
        assert ROW_KEYS <= set(r)
        assert len(r["passages"]) == 2
        assert 0.0 <= r["top1"] <= 1.0 and r["kl"] >= 0.0
        assert r["ratio"] == pytest.approx(r["bf16_bytes"] / r["stored_bytes"])
    assert rows["identity"]["delta_ppl"] == 0.0 and rows["identity"]["top1"] == 1.0
    assert rows["zero:streams=v"]["verdict"] == "REJECT"
    # hqq ships no 3-bit path for the cache; where hqq is absent (an optional extra), that.
    why = "3-bit" if importlib.util.find_spec("hqq") else "hqq is not installed"
    assert why in rows["hf-hqq:bits=3"]["skipped"]


def test_sweep_then_report(tmp_path, data):
    out = tmp_path / "sweep.json"
    argv = [
        "eval",
        "sweep",
        *data,
        "--no-progress",
        "--family",
        "bf16",
        "--family",
        "kivi:bits={bits}",
    ]
    argv += ["--family", "kivi:bits={bits},group=16", "--bits", "2", "4", "--out", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "sweep"
    table = res["table"]
    assert [e["method"] for e in table][:1] == ["kivi:bits=2"]  # highest ratio first
    ratios = [e["ratio"] for e in table]
    assert ratios == sorted(ratios, reverse=True)
    assert table[0]["pareto"] and table[0]["pareto_kl"]  # nothing compresses more
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["report", "--results", str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert res["command"] in readme
    assert "`kivi:bits=2,group=16`" in readme and "![Pareto plot](sweep.png)" in readme


def test_register_adds_commands_to_a_foreign_parser(capsys, tmp_path):
    parser = argparse.ArgumentParser(prog="kakeyaturbo")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "methods"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "turboquant" in out
    # Every shared option the methods take is listed, from the one table they are parsed by.
    from dataclasses import fields

    from kakeyaturbo.eval.methods import COMMON_KEYS, MethodOptions

    assert set(COMMON_KEYS) == {f.name for f in fields(MethodOptions)}
    assert all(f" {key}=" in out for key in COMMON_KEYS)
    args = parser.parse_args(["report", "--results", str(tmp_path)])
    assert callable(args.func)
