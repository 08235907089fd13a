"""The generate bench's rounds: every method once per round, the reference first, and no method
always after the same one (benches/hf_generate.py --rounds)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))

from hf_generate import rotations  # noqa: E402


def test_every_round_runs_every_method_once_and_the_reference_first():
    methods = ["dynamic", "quanto", "kakeya", "kakeya+budget"]
    order = rotations(methods, 5)
    assert len(order) == 5 * len(methods)
    assert order[: len(methods)] == methods
    for r in range(5):
        assert sorted(order[r * 4 : (r + 1) * 4]) == sorted(methods)


def test_a_method_follows_different_ones_across_rounds():
    order = rotations(["dynamic", "quanto", "kakeya"], 3)
    before = {order[i - 1] for i in range(1, len(order)) if order[i] == "kakeya"}
    assert before == {"dynamic", "quanto"}


def test_one_round_is_the_given_order():
    assert rotations(["a", "b"], 1) == ["a", "b"]
