"""`eval table`: the short table run.sh ends with, read from an `eval ppl`/`sweep` result."""

from __future__ import annotations

import json

import pytest

from kakeyaturbo.cli import main
from kakeyaturbo.eval.summary import format_table


def _row(method, ratio, dppl, kl, top1, verdict):
    return dict(method=method, ratio=ratio, delta_ppl=dppl, kl=kl, top1=top1, verdict=verdict)


RESULT = {
    "passages": 4,
    "ctx": 960,
    "n_eval": 64,
    "mode": "snapshot",
    "methods": [
        _row("fp8", 2.0, 0.0043, 1.72e-3, 0.965, "ACCEPT"),
        _row("kakeya", 3.42, -0.0045, 4.37e-3, 0.941, "MARGINAL"),
        {"method": "hf-quanto:bits=4", "skipped": "optimum-quanto is not installed"},
        _row("kivi:bits=4", 3.2, 0.0065, 4.63e-3, 0.973, "ACCEPT"),
    ],
}


def test_rows_best_ratio_first_with_the_marked_row_and_the_skipped_peer_named():
    lines = format_table(RESULT, mark="kakeya").splitlines()
    body = lines[1:4]
    order = [line.lstrip("* ").split()[0] for line in body]
    assert order == ["kakeya", "kivi:bits=4", "fp8"]
    assert body[0].startswith("* kakeya") and not body[1].startswith("*")
    assert "3.42x" in body[0] and "-0.45%" in body[0] and "4.37e-03" in body[0]
    assert "94.1%" in body[0] and body[0].endswith("MARGINAL")
    assert any("hf-quanto:bits=4: not run: optimum-quanto is not installed" in x for x in lines)
    assert any("4 passages, ctx 960 + 64" in x for x in lines)
    # the columns line up: every ratio ends at the same column
    ends = {line.index("x ") for line in body}
    assert len(ends) == 1


def test_not_a_result_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "layers"}))
    assert main(["eval", "table", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not an eval ppl or sweep result" in err


def test_cli_prints_the_table(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(RESULT))
    assert main(["eval", "table", str(path), "--mark", "kakeya"]) == 0
    out = capsys.readouterr().out
    assert "* kakeya" in out and "ACCEPT: |delta-ppl| <= 1%" in out


@pytest.mark.parametrize("result", [{}, {"methods": "x"}])
def test_format_table_refuses_what_has_no_methods(result):
    with pytest.raises(ValueError, match="no 'methods' list"):
        format_table(result)
