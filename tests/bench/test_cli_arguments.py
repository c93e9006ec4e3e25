"""Bad command-line values: a one-line usage error, before any work (no traceback, no server started)."""

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
        (["bench", "replay", "t.jsonl", "--multipliers", "2,0.5"],
         "argument --multipliers: must be a finite number >= 1"),
        (["bench", "serve", "--rates", "abc"], "argument --rates: not a number: 'abc'"),
        (["bench", "serve", "--replicas", "0"], "argument --replicas: must be an integer >= 1"),
        (["bench", "serve", "--concurrency", "0"], "argument --concurrency: must be an integer >= 1"),
        (["bench", "serve", "--tool-gap", "inf"], "argument --tool-gap: must be a finite number >= 0"),
        (["demo", "--sessions", "0"], "argument --sessions: must be an integer >= 1"),
        (["demo", "--rates", "0.1,0"], "argument --rates: must be a finite number > 0, got '0'"),
        (["bench", "bound", "t.jsonl", "--blocks", "0"], "argument --blocks: must be an integer >= 1"),
        (["bench", "soak", "--concurrency", "0"], "argument --concurrency: must be an integer >= 1"),
        (["bench", "soak", "--cases", "valid_chat,nope"], "argument --cases: unknown cases ['nope']"),
        (["bench", "soak", "--minutes", "-1"], "argument --minutes: must be a finite number > 0"),
        (["cluster", "up", "--port", "70000", "m"], "argument --port: must be a port number (1 to 65535), got '70000'"),
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
    with pytest.raises(SystemExit) as exit_info:  # one server: refused before the model is built
        main(["bench", "serve", "--blocks", "10"])
    assert str(exit_info.value.code) == ("agentkv bench serve: --blocks 10 leaves less than --max-model-len 2048 "
                                         "tokens")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["up", "--replicas", "0", "MODEL"], "argument --replicas: must be an integer >= 1"),
        (["up", "--sync-interval", "0", "MODEL"], "argument --sync-interval: must be a finite number > 0"),
    ],
)
def test_cluster_up_refuses_bad_values(argv, message, capsys):
    from agentkv import cluster

    with pytest.raises(SystemExit) as exit_info:
        cluster.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cluster_up_names_options_that_do_not_combine():
    from agentkv import cluster

    with pytest.raises(SystemExit) as exit_info:
        cluster.main(["up", "--router-policy", "kv_aware", "MODEL"])
    assert str(exit_info.value.code) == ("agentkv cluster up: kv_aware routing needs the replicas' --block-size "
                                         "(the router hashes blocks too)")
