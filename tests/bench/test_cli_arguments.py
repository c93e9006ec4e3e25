"""Bad command-line values of the bench and demo commands: a one-line usage error, before any work."""

from __future__ import annotations

import pytest

from agentkv.__main__ import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "tape", "--sessions", "0", "-o", "t.jsonl"], "--sessions: must be an integer >= 1, got '0'"),
        (["bench", "tape", "--rate", "-1", "-o", "t.jsonl"], "argument --rate: must be a finite number > 0"),
        (["bench", "tape", "--sessions", "1.5", "-o", "t.jsonl"], "argument --sessions: not an integer: '1.5'"),
        (["bench", "replay", "t.jsonl", "--margin", "nan"], "argument --margin: must be a finite number, got 'nan'"),
        (["bench", "replay", "t.jsonl", "--ttl", "-5"], "argument --ttl: must be a finite number >= 0"),
        (["bench", "replay", "t.jsonl", "--jobs", "0"], "argument --jobs: must be an integer >= 1"),
        (["bench", "replay", "t.jsonl", "--capacities", "600,0"], "argument --capacities: must be an integer >= 1"),
        (["bench", "replay", "t.jsonl", "--multipliers", ","], "argument --multipliers: no values in ','"),
        (["bench", "serve", "--rates", "abc"], "argument --rates: not a number: 'abc'"),
        (["bench", "serve", "--replicas", "0"], "argument --replicas: must be an integer >= 1"),
        (["bench", "serve", "--concurrency", "0"], "argument --concurrency: must be an integer >= 1"),
        (["bench", "serve", "--tool-gap", "inf"], "argument --tool-gap: must be a finite number >= 0"),
        (["demo", "--sessions", "0"], "argument --sessions: must be an integer >= 1"),
        (["demo", "--rates", "0.1,0"], "argument --rates: must be a finite number > 0, got '0'"),
    ],
)
def test_bad_values_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_options_the_benchmark_cannot_combine_exit_with_one_line():
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--replicas", "4", "--blocks", "100"])
    text = str(exit_info.value.code)
    assert text.startswith("agentkv bench serve: --blocks 100 split over 4 replicas leaves less than")
    assert "\n" not in text
