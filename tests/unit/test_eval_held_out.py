"""`eval held-out`: passages overlapping a chosen run are excluded, the rest re-aggregated."""

from __future__ import annotations

import json
import math

import pytest

from kakeyaturbo.eval.cli import main
from kakeyaturbo.eval.held_out import held_out, text_windows


def _result(starts, deltas, protocol="passages", text="wiki.txt"):
    """An `eval ppl` result whose one method adds `deltas[i]` nats to passage i's NLL."""
    rows = [
        {"index": i, "start": s, "nll_ref": 2.0, "nll": 2.0 + d, "kl": abs(d), "top1": 1.0 - abs(d)}
        for i, (s, d) in enumerate(zip(starts, deltas, strict=True))
    ]
    return {
        "kind": "ppl",
        "text": text,
        "ctx": 9,
        "n_eval": 4,
        "protocol": protocol,
        "passage_starts": list(starts),
        "methods": [{"method": "m", "ratio": 5.0, "passages": rows}],
    }


def test_windows_follow_the_protocol():
    assert text_windows(_result([0, 100], [0, 0])) == [(0, 14), (100, 114)]
    # the copying test writes each window of ceil(14 / 2) tokens twice
    assert text_windows(_result([0], [0], protocol="copy")) == [(0, 7)]


def test_overlapping_passages_are_excluded_and_the_rest_aggregated():
    big = _result([0, 20, 40, 60], [0.5, 0.01, 0.5, 0.03])
    chosen = _result([5, 45], [0, 0])  # windows [5, 19) and [45, 59)
    (row,) = held_out(big, [chosen])
    assert (row.n_held_out, row.n_chosen) == (2, 2)
    assert row.held_out.delta_ppl == pytest.approx(math.expm1(0.02))
    assert row.chosen.delta_ppl == pytest.approx(math.expm1(0.5))
    assert row.held_out.verdict == "MARGINAL"  # +2.0%, top-1 98%; the chosen two REJECT
    assert row.chosen.top1 == pytest.approx(0.5)


def test_touching_windows_do_not_overlap():
    (row,) = held_out(_result([0, 14], [0.0, 0.0]), [_result([28], [0.0])])
    assert row.n_held_out == 2 and row.chosen is None


def test_nothing_held_out_or_another_text_is_an_error():
    big = _result([0, 20], [0, 0])
    with pytest.raises(ValueError, match="none is held out"):
        held_out(big, [_result([0, 19], [0, 0])])
    with pytest.raises(ValueError, match="another text"):
        held_out(big, [_result([50], [0], text="other.txt")])
    bad = _result([0, 20], [0, 0])
    bad["methods"][0]["passages"].pop()
    with pytest.raises(ValueError, match="1 passages scored, 2 passage starts"):
        held_out(bad, [_result([50], [0])])


def test_cli_writes_the_table(tmp_path, capsys):
    big, chosen = tmp_path / "big.json", tmp_path / "chosen.json"
    big.write_text(json.dumps(_result([0, 20, 40], [0.001, 0.002, 0.5])))
    chosen.write_text(json.dumps(_result([40], [0.0])))
    out = tmp_path / "held_out.txt"
    assert main(["eval", "held-out", str(big), "--chosen", str(chosen), "--out", str(out)]) == 0
    text = out.read_text()
    assert text == capsys.readouterr().out
    assert text.startswith("$ kakeyaturbo eval held-out ")
    held, chosen_row = [line.split() for line in text.splitlines() if line.startswith("  ")]
    assert held[:4] == ["held", "out", "2", "5.00x"] and held[-1] == "ACCEPT"
    assert chosen_row[:4] == ["chosen", "on", "1", "5.00x"] and chosen_row[-1] == "REJECT"
