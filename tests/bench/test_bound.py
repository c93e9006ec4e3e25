"""``agentkv bench bound``: a request trace under LRU and Belady, exactly, and its bad input."""

from __future__ import annotations

import json

import pytest

from agentkv.__main__ import main
from agentkv.bench.bound import TraceError, bound, read_trace

BLOCK = 4


def _line(request_id: str, blocks: list[str], *, hit: int = 0, extra: int = 1, **fields: object) -> str:
    row = {"t": 0.0, "id": request_id, "agent": "a", "session": "s", "parent": None, "warmup": False,
           "tokens": len(blocks) * BLOCK + extra, "hit": hit, "block_size": BLOCK, "pool_blocks": 3,
           "blocks": blocks, **fields}
    return json.dumps(row) + "\n"


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(lines))
    return path


def test_lru_and_belady_hit_what_each_order_keeps(tmp_path):
    # 3 blocks: x1 x2 | y1 y2 | x1 x2 | y1 (prompts of 2 blocks + 1 token, the last of 1 block + 1)
    path = _write(tmp_path, [
        _line("r0", ["x1", "x2"]),
        _line("r1", ["y1", "y2"]),
        _line("r2", ["x1", "x2"], hit=2 * BLOCK),
        _line("r3", ["y1"]),
    ])
    result = bound(read_trace(path))
    total = 3 * (2 * BLOCK + 1) + BLOCK + 1
    assert result.capacity == 3 and result.prompt_tokens == total
    # LRU: r1 evicts x2 (a chain's child goes first), so r2 hits x1 only and evicts y2, and r3 hits y1
    assert result.lru == pytest.approx(2 * BLOCK / total)
    # Belady: r1 evicts y2 (never used again), so r2 hits both blocks and r3 hits y1
    assert result.belady == pytest.approx(3 * BLOCK / total)
    assert result.measured == pytest.approx(2 * BLOCK / total) and result.closed == 0.0


def test_a_hit_never_covers_the_prompts_last_token(tmp_path):
    # a prompt of exactly two blocks: vLLM computes its last token, so at most one block is a hit
    path = _write(tmp_path, [_line("r0", ["x1", "x2"], extra=0), _line("r1", ["x1", "x2"], extra=0)])
    result = bound(read_trace(path), 4)
    assert result.lru == result.belady == pytest.approx(BLOCK / (4 * BLOCK))


def test_malformed_and_repeated_lines_are_skipped_and_counted(tmp_path):
    path = _write(tmp_path, [
        "not json\n",
        _line("r0", ["x1"]),
        _line("r0", ["x1"]),  # admitted again after a preemption: counted once
        json.dumps({"id": "r1"}) + "\n",
        _line("r2", ["x1", "x2", "x3"], extra=-BLOCK),  # more full blocks than tokens
        "\n",
        _line("r3", ["x1"], hit=99),  # more hits than tokens
        '{"id": "r4", "t": 1, "tokens": Infinity, "hit": 0, "blocks": [], "block_size": 4}\n',  # no int holds it
        json.dumps({"id": "r5", "t": 1, "tokens": 0, "hit": 0, "blocks": [], "block_size": 4}) + "\n",  # no prompt
    ])
    with open(path, "ab") as f:
        f.write(b'{"id": "r6", "t": 1, "tokens": 4, "hit": 0, "blocks": [], "block_size": 4, "agent": "\xff\xfe"}\n')
    trace = read_trace(path)
    assert [r.id for r in trace.requests] == ["r0", "r6"] and trace.skipped == 7
    assert trace.requests[1].agent == "\ufffd\ufffd"  # not UTF-8: read with replacement characters


@pytest.mark.parametrize(("lines", "message"), [
    ([], "no request line"),
    ([_line("r0", ["x1"]), _line("r1", ["x1"], block_size=8, extra=5)], "block sizes [4, 8]"),
])
def test_traces_that_cannot_be_replayed_are_refused(tmp_path, lines, message):
    with pytest.raises(TraceError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_trace(_write(tmp_path, lines))


def test_a_pool_smaller_than_the_largest_prompt_is_refused(tmp_path):
    trace = read_trace(_write(tmp_path, [_line("r0", ["x1", "x2", "x3", "x4"])]))
    with pytest.raises(TraceError, match="cannot hold"):
        bound(trace)  # the traced pool: 3 blocks


def test_the_command_prints_the_figures_or_one_line_why_not(tmp_path, capsys):
    path = _write(tmp_path, [_line("r0", ["x1", "x2"]), _line("r1", ["x1", "x2"], hit=BLOCK)])
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "bound", str(path), "--json"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    figures = json.loads(printed)
    assert figures["capacity"] == 3 and figures["lru"] == figures["belady"] == pytest.approx(2 * BLOCK / 18)
    assert figures["closed"] is None and "NaN" not in printed  # no gap to close: null, valid JSON
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "bound", str(tmp_path / "missing.jsonl")])
    assert exit_info.value.code == 2
    assert "No such file" in capsys.readouterr().out


def test_the_trace_as_a_tape_replays_the_same_prefixes(tmp_path):
    from agentkv.bench.plan import TapePlan
    from agentkv.bench.replay import replay
    from agentkv.bench.tape import read_tape

    path = _write(tmp_path, [
        _line("r0", ["x1", "x2"], t=0.0, agent="planner", session="s1", parent="", step=0),
        _line("r1", ["x1", "y1"], t=5.0, agent="planner", session="s2", parent="", step=0),
        _line("r2", ["x1", "x2", "x3"], t=9.0, agent="coder", session="s1", parent="planner", step=1),
        _line("r3", [], t=12.0, agent=None, session=None, parent=None, extra=3),
    ])
    trace = read_trace(path)
    tape_path = tmp_path / "tape.jsonl"
    assert main_exit(["bench", "bound", str(path), "--blocks", "16", "--tape", str(tape_path)]) == 0
    tape = read_tape(tape_path)
    assert [(r.id, r.session, r.agent, r.parent, r.step) for r in tape.requests] == [
        ("r0", "s1", "planner", "", 0), ("r1", "s2", "planner", "", 0), ("r2", "s1", "coder", "planner", 1),
        ("r3", "untagged-r3", "untagged", None, None)]
    assert tape.requests[1].segments == (("anchor/x1", BLOCK), ("b/y1", BLOCK), ("r1/rest", 1))  # x1: two sessions
    # with room for everything, the replay hits exactly the prefixes the trace says are equal
    hits = replay(TapePlan(tape), "lru", 17).to_json()["hit_tokens"]
    assert hits == round(bound(trace, 16).lru * bound(trace, 16).prompt_tokens) == BLOCK + 2 * BLOCK


def main_exit(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return int(exit_info.value.code or 0)


def test_skipped_sessions_fill_the_cache_but_are_not_counted(tmp_path, capsys):
    # a warm-up session caches x1 x2; the measured session's call hits them (it is the only one counted)
    path = _write(tmp_path, [_line("w0", ["x1", "x2"], session="warmup-0"),
                             _line("r0", ["x1", "x2"], hit=2 * BLOCK, session="s")])
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "bound", str(path), "--json", "--skip-sessions", "warmup-"])
    assert exit_info.value.code == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["requests"] == 1 and figures["prompt_tokens"] == 2 * BLOCK + 1
    assert figures["lru"] == figures["belady"] == figures["measured"] == pytest.approx(2 * BLOCK / (2 * BLOCK + 1))
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "bound", str(path), "--skip-sessions", ""])  # "" skips nothing
    assert exit_info.value.code == 0 and "2 requests" in capsys.readouterr().out
    only_warmups = _write(tmp_path, [_line("w0", ["x1"], session="warmup-0"), _line("w1", ["x1"], session="warmup-1")])
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "bound", str(only_warmups), "--skip-sessions", "warmup-"])
    assert exit_info.value.code == 2
    assert "no request outside the sessions starting with 'warmup-'" in capsys.readouterr().out


def test_belady_evicts_a_child_before_its_parent_when_both_are_next_used_together(tmp_path):
    # 2 blocks: a|z, then x fills one slot; a and z are next used together (r3): keeping the
    # parent a hits it, keeping the child z alone hits nothing (the keys once decided: z < a)
    path = _write(tmp_path, [
        _line("r0", ["a", "z"], pool_blocks=2),
        _line("r1", ["x"], pool_blocks=2),
        _line("r2", ["x"], hit=BLOCK, pool_blocks=2),
        _line("r3", ["a", "z"], hit=BLOCK, pool_blocks=2),
    ])
    result = bound(read_trace(path))
    assert result.belady >= result.lru and result.belady == pytest.approx(2 * BLOCK / result.prompt_tokens)
