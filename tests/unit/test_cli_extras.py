"""A command whose extra is missing says which extra to install, before it checks arguments."""

from __future__ import annotations

import importlib.util

import pytest

from kakeyaturbo import cli


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["eval", "ppl", "--model", "nope", "--text", "nope.txt", "--method", "kakeya"], "eval"),
        (["eval", "methods"], "eval"),
        (["capture", "--model", "nope", "--text", "nope.txt", "--out", "kv.safetensors"], "hf"),
        (["calibrate", "--model", "nope", "--text", "nope.txt", "--out", "calib"], "hf"),
    ],
)
def test_a_missing_package_names_the_extra_not_the_arguments(argv, extra, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: kakeyaturbo {argv[0]} needs 'torch', which is not installed: "
        f"pip install 'kakeyaturbo[{extra}]'"
    )


def test_the_base_install_commands_need_no_extra(monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(SystemExit) as exit_:  # reaches its own argument check
        cli.main(["bench", "missing.npy"])
    assert exit_.value.code == 2
    assert "tensor file 'missing.npy' does not exist" in capsys.readouterr().err
