"""Evaluation suite: quality and bytes of KV codecs, side by side with peer codecs.

`kakeyaturbo eval ppl|bytes|sweep|layers` and `kakeyaturbo report` live in `cli.py`; the pieces:
`harness` (prefill, compress, teacher-force, compare; `hot_window` for its in-forward-hot
protocol), `metrics` (delta-ppl, KL, top-1, paired
confidence intervals, verdicts), `methods` (specs and the registry), `baselines` (peer codecs),
`kakeya` (the project's codec as a method), `bytes_report`, `sweep`, `diagnostics`, `report`.
"""
