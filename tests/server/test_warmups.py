"""Warm-up outcomes and anchor residency, counted by AgentKVRuntime on a real vLLM KVCacheManager."""

from __future__ import annotations

import random

import jsonschema

from agentkv.protocol import STATS_SCHEMA, AgentTag
from server_patch._metrics import render_metrics
from server_patch._runtime import AgentKVRuntime, RuntimeConfig
from server_patch._warmups import DEFAULT_WINDOW, MAX_PENDING, SURVIVAL_WINDOW, WarmupLedger

from .test_runtime import AGENTS, ANCHOR_BLOCKS, BS, anchor, manager, request, run

NUM_BLOCKS = 40  # 39 usable blocks: one request of 39 blocks evicts every cached block


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def setup(clock: Clock | None = None) -> tuple[AgentKVRuntime, object]:
    kv = manager(NUM_BLOCKS)
    runtime = AgentKVRuntime(RuntimeConfig(refresh_interval=0.0), clock=clock or Clock())
    runtime.install(kv)
    for s in ("s0", "s1"):  # two sessions teach the coder's anchor length
        run(kv, runtime, request(anchor("coder") + history(s), AgentTag("coder", s)))
    return runtime, kv


def history(session: str, blocks: int = 2) -> list[int]:
    start = 500_000 + 10_000 * int(session[1:])
    return [*range(start, start + blocks * BS), 7]


def evict_everything(kv: object, runtime: AgentKVRuntime) -> None:
    run(kv, runtime, request(list(range(900_000, 900_000 + (NUM_BLOCKS - 1) * BS - 1)), None))


def warmup(kv: object, runtime: AgentKVRuntime, agent: str = "coder") -> int:
    return run(kv, runtime, request(anchor(agent), AgentTag(agent, warmup=True)))


def outcomes(runtime: AgentKVRuntime) -> dict[str, object]:
    return runtime.stats(max_age=0)["warmups"]


def test_residency_follows_the_cache() -> None:
    runtime, kv = setup()
    assert runtime.anchor_residency("coder") == (ANCHOR_BLOCKS, ANCHOR_BLOCKS)
    assert runtime.anchor_residency("nobody") == (0, 0)
    evict_everything(kv, runtime)
    assert runtime.anchor_residency("coder") == (0, ANCHOR_BLOCKS)
    warmup(kv, runtime)
    stats = runtime.stats(max_age=0)
    assert stats["agents"]["coder"]["anchor_resident_blocks"] == ANCHOR_BLOCKS
    assert stats["kv_free_blocks"] == NUM_BLOCKS - 1  # nothing running: every block is free or evictable
    jsonschema.validate(stats, STATS_SCHEMA)


def test_before_its_anchor_is_learned_residency_counts_the_latest_first_call() -> None:
    """One session: no anchor length yet, so the cached leading blocks of the agent's latest
    session's first call are reported (the coordinator compares them with the anchor it holds)."""
    kv = manager(NUM_BLOCKS)
    runtime = AgentKVRuntime(RuntimeConfig(refresh_interval=0.0), clock=Clock())
    runtime.install(kv)
    run(kv, runtime, request(anchor("coder") + history("s0"), AgentTag("coder", "s0")))
    run(kv, runtime, request(anchor("coder") + history("s0", 4), AgentTag("coder", "s0")))  # not a first call
    assert runtime.anchor_residency("coder") == (ANCHOR_BLOCKS + 2, 0)
    assert runtime.view()["anchors"]["coder"] == [ANCHOR_BLOCKS + 2, 0]
    evict_everything(kv, runtime)
    assert runtime.anchor_residency("coder") == (0, 0)
    run(kv, runtime, request(anchor("coder") + history("s1"), AgentTag("coder", "s1")))  # a second session
    assert runtime.anchor_residency("coder") == (ANCHOR_BLOCKS, ANCHOR_BLOCKS)


def test_warmup_then_the_agents_call_hitting_it_is_useful() -> None:
    clock = Clock()
    runtime, kv = setup(clock)
    evict_everything(kv, runtime)
    assert warmup(kv, runtime) == 0  # the anchor was cold
    no_lead = {"bounds": [0.05, 0.2, 1.0, 5.0, 30.0], "counts": [0] * 6, "sum": 0.0}
    assert outcomes(runtime) | {"wasted_by": None} == {
        "sent": 1, "useful": 0, "wasted": 0, "redundant": 0, "pending": 1, "wasted_by": None, "window_s": 120.0,
        "useful_lead_s": no_lead}
    clock.now += 0.1
    other = run(kv, runtime, request(anchor("reviewer") + history("s7"), AgentTag("reviewer", "s7")))
    assert other == 0 and outcomes(runtime)["pending"] == 1  # another agent's call settles nothing
    hit = run(kv, runtime, request(anchor("coder") + history("s2"), AgentTag("coder", "s2")))
    assert hit == ANCHOR_BLOCKS * BS
    assert outcomes(runtime) == {"sent": 1, "useful": 1, "wasted": 0, "redundant": 0, "pending": 0,
                                 "wasted_by": {"evicted": 0, "expired": 0, "missed": 0, "superseded": 0},
                                 "window_s": 120.0,  # the call came 0.1 s after its warm-up: in (0.05, 0.2]
                                 "useful_lead_s": no_lead | {"counts": [0, 1, 0, 0, 0, 0], "sum": 0.1}}
    text = render_metrics(runtime.stats(max_age=0), strict=False).decode()
    assert 'agentkv_warmups_total{outcome="useful"} 1.0' in text
    assert 'agentkv_warmups_total{outcome="sent"} 1.0' in text
    for line in ('agentkv_warmup_lead_seconds_bucket{le="0.05"} 0.0',
                 'agentkv_warmup_lead_seconds_bucket{le="0.2"} 1.0',
                 'agentkv_warmup_lead_seconds_bucket{le="+Inf"} 1.0',
                 "agentkv_warmup_lead_seconds_count 1.0", "agentkv_warmup_lead_seconds_sum 0.1"):
        assert line in text, line
    assert f'agentkv_anchor_resident_blocks{{agent="coder"}} {float(ANCHOR_BLOCKS)}' in text
    assert f'agentkv_anchor_length_blocks{{agent="coder"}} {float(ANCHOR_BLOCKS)}' in text
    assert f"agentkv_kv_free_blocks {float(NUM_BLOCKS - 1)}" in text
    assert runtime.view()["warmups"] == [1, 0]


def test_warmup_evicted_before_use_is_wasted() -> None:
    runtime, kv = setup()
    evict_everything(kv, runtime)
    warmup(kv, runtime)
    evict_everything(kv, runtime)
    stats = outcomes(runtime)
    assert (stats["sent"], stats["useful"], stats["wasted"], stats["pending"]) == (1, 0, 1, 0)
    assert stats["wasted_by"]["evicted"] == 1
    assert run(kv, runtime, request(anchor("coder") + history("s2"), AgentTag("coder", "s2"))) == 0
    assert outcomes(runtime)["wasted"] == 1  # settled once
    assert runtime.view()["warmups"] == [0, 1]  # (useful, failed): what a decision weighs P by


def test_warmup_of_a_resident_anchor_is_redundant() -> None:
    runtime, kv = setup()
    assert warmup(kv, runtime) == (ANCHOR_BLOCKS - 1) * BS  # vLLM computes the last block again
    stats = outcomes(runtime)
    assert (stats["sent"], stats["redundant"], stats["pending"]) == (1, 1, 0)


def test_unused_warmup_expires_and_a_call_without_the_anchor_misses() -> None:
    clock = Clock()
    runtime, kv = setup(clock)
    evict_everything(kv, runtime)
    warmup(kv, runtime)
    clock.now += 121
    assert outcomes(runtime)["wasted_by"]["expired"] == 1
    evict_everything(kv, runtime)
    warmup(kv, runtime)
    run(kv, runtime, request(list(range(700_000, 700_000 + 3 * BS)), AgentTag("coder", "s9")))  # another prefix
    stats = outcomes(runtime)
    assert (stats["sent"], stats["useful"], stats["wasted"]) == (2, 0, 2)
    assert stats["wasted_by"]["missed"] == 1
    assert runtime.view()["warmups"] == [0, 1]  # an expired warm-up says nothing about surviving


def test_warmups_do_not_count_as_the_agents_queries() -> None:
    runtime, kv = setup()
    before = runtime.stats(max_age=0)["agents"]["coder"]
    warmup(kv, runtime)
    after = runtime.stats(max_age=0)["agents"]["coder"]
    assert (after["queries"], after["hits"]) == (before["queries"], before["hits"])


def test_residency_by_bisection_counts_the_cached_leading_blocks_exactly() -> None:
    """The bisection ``anchor_residency`` does equals a block-by-block scan of the prefix while
    random sessions of four agents, with first calls of 1-12 blocks, evict one another."""
    rng = random.Random(7)
    kv = manager(NUM_BLOCKS)
    runtime = AgentKVRuntime(RuntimeConfig(refresh_interval=0.0), clock=Clock())
    runtime.install(kv)
    pool = kv.block_pool
    partial = 0
    for step in range(300):
        agent = rng.choice(AGENTS)
        first_call = list(range(0, rng.randint(1, 12) * BS)) if rng.random() < 0.5 else anchor(agent)
        tokens = [10_000_000 * (AGENTS.index(agent) + 1) + t for t in first_call] + history(f"s{step}")
        run(kv, runtime, request(tokens, AgentTag(agent, f"s{step}")))
        for name in AGENTS:
            scanned = 0
            for block_hash in runtime.anchors.anchor_hashes(name):
                if pool.get_cached_block(block_hash, [0]) is None:
                    break
                scanned += 1
            assert runtime.anchor_residency(name)[0] == scanned
            partial += 0 < scanned < len(runtime.anchors.anchor_hashes(name))
    assert partial > 0  # some prefixes were cut part of the way, not only whole or gone


def test_survival_is_read_over_the_latest_outcomes_only() -> None:
    """The view's ``warmups`` (what a decision weighs P by) follows the pool's pressure: the latest
    SURVIVAL_WINDOW outcomes that tell survival, while the stats keep the whole life's counts."""
    clock = Clock()
    ledger = WarmupLedger(clock)
    for i in range(SURVIVAL_WINDOW):  # a phase under pressure: every warm-up evicted first
        ledger.warmed("coder", [("w", i)], 0, 1)
        ledger.evicted(("w", i))
    assert ledger.outcomes() == (0, SURVIVAL_WINDOW)
    for i in range(30):  # then room: every warm-up hit by its agent's call
        ledger.warmed("coder", [("u", i)], 0, 1)
        ledger.used("coder", [("u", i)], 1)
    ledger.warmed("coder", [("x", 0)], 0, 1)
    clock.now += DEFAULT_WINDOW + 1  # an expired warm-up says nothing about surviving
    assert ledger.outcomes() == (30, SURVIVAL_WINDOW - 30)
    assert (ledger.counts["useful"], ledger.wasted["evicted"], ledger.wasted["expired"]) == (30, SURVIVAL_WINDOW, 1)


def test_a_warmup_replaced_by_a_newer_one_is_superseded_and_says_nothing_about_survival() -> None:
    ledger = WarmupLedger(Clock())
    ledger.warmed("coder", [("old", 0)], 0, 1)
    ledger.warmed("coder", [("new", 0)], 0, 1)  # the agent's prompt changed before its call came
    ledger.used("coder", [("new", 0)], 1)
    assert ledger.outcomes() == (1, 0)  # the decision's survival counts the useful one only
    stats = ledger.stats()
    assert (stats["sent"], stats["useful"], stats["wasted"], stats["pending"]) == (2, 1, 1, 0)
    assert stats["wasted_by"]["superseded"] == 1
    ledger.evicted(("old", 0))  # the replaced warm-up's blocks no longer settle anything
    assert ledger.stats()["wasted"] == 1


def test_warmups_of_ever_new_agent_names_keep_a_bounded_ledger() -> None:
    """Agent names are the client's: warm-ups of more agents than MAX_PENDING within the window
    supersede the oldest pending ones instead of piling up (with their block hashes)."""
    ledger = WarmupLedger(Clock())
    for i in range(MAX_PENDING + 76):
        ledger.warmed(f"agent-{i}", [("w", i, b) for b in range(8)], 0, 8)
    stats = ledger.stats()
    assert stats["pending"] == MAX_PENDING and stats["wasted_by"]["superseded"] == 76
    assert stats["sent"] == stats["useful"] + stats["wasted"] + stats["redundant"] + stats["pending"]
    assert len(ledger._holders) == 8 * MAX_PENDING
    ledger.used("agent-0", [("w", 0, b) for b in range(8)], 8)  # superseded already: settles nothing
    ledger.used(f"agent-{MAX_PENDING + 75}", [("w", MAX_PENDING + 75, b) for b in range(8)], 8)
    assert ledger.stats()["useful"] == 1


def test_the_view_lists_the_64_agents_seen_most_recently() -> None:
    runtime, kv = setup()
    for number in range(80):  # an app of many agents: each calls once
        run(kv, runtime, request([*range(700_000 + number * 100, 700_000 + number * 100 + BS), 7],
                                 AgentTag(f"agent-{number:02d}", f"m{number}")))
    anchors = runtime.view()["anchors"]
    assert set(anchors) == {f"agent-{number:02d}" for number in range(16, 80)}  # coder and 00-15 left out
