"""``agentkv bench micro`` (``make bench-micro``) runs and prints its table (the figures are the benchmark's)."""

from __future__ import annotations

from agentkv.__main__ import main


def test_the_microbenchmark_prints_a_row_per_agent_count(capsys):
    main(["bench", "micro"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row[0].strip() for row in rows[1:]] == ["6", "12", "24"]
    assert all(float(cell) > 0 for row in rows[1:] for cell in row)
