"""`kakeyaturbo report`'s page: a results folder's hand-written index survives regeneration."""

from __future__ import annotations

from kakeyaturbo.eval.report import INDEX, render


def test_the_folders_index_follows_the_header_and_is_optional(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")  # skipped, not fatal
    without = render(tmp_path, all_command="bash make_reports.sh")
    assert "bash make_reports.sh" in without and "What each file shows" not in without
    (tmp_path / INDEX).write_text("## What each file shows\n\n- `a.json`: a run.\n")
    page = render(tmp_path, all_command="bash make_reports.sh")
    assert page.index("bash make_reports.sh") < page.index("## What each file shows")
    assert page.startswith(without.rstrip("\n"))
