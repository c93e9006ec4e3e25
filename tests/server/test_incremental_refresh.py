"""Incremental refresh on real vLLM KVCacheManager objects: re-scoring only the sessions whose
scores moved evicts exactly what re-scoring every group evicts."""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Iterable
from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from agentkv.bench.kv_manager import make_manager, serve_once
from agentkv.graph import History
from agentkv.protocol import AgentTag
from server_patch._free_queue import ScoredFreeBlockQueue
from server_patch._runtime import AgentKVRuntime, RuntimeConfig
from tests.server.test_runtime import manager, pipeline_sessions, request, run

BS = 16
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def _workload(seed: int, count: int) -> list[tuple[float, Request | None, str | None, bool | None]]:
    """(clock, request, session ended before it, told answer after it): a random chain of 3-8
    agents with 1-4 block anchors, tool loops, told answers, untagged requests, session ends (of
    live sessions, of sessions idle for long, or of ones ended already) and ended sessions called
    again."""
    rng = random.Random(seed)
    agents = [f"a{i}" for i in range(rng.randint(3, 8))]
    following = {a: rng.sample(agents, rng.randint(1, 3)) for a in agents}
    anchors = {a: list(range(10**6 * (i + 1), 10**6 * (i + 1) + BS * rng.randint(1, 4))) for i, a in enumerate(agents)}
    live: dict[str, list] = {}
    over: dict[str, list] = {}
    out = []
    clock, started = 0.0, 0
    for i in range(count):
        clock += rng.expovariate(20.0)
        ended = None
        if live and rng.random() < 0.03:
            ended = rng.choice(sorted(live))
            over[ended] = live.pop(ended)
        elif over and rng.random() < 0.02:  # an end told twice (or late), or a call that revives one
            name = rng.choice(sorted(over))
            if rng.random() < 0.5:
                ended = name
            else:
                live[name] = over.pop(name)
        if (len(live) < 20 and rng.random() < 0.15) or not live:
            started += 1
            live[f"s{started}"] = [rng.choice(agents), 0, None, []]
        session = rng.choice(sorted(live))
        state = live[session]
        if state[2] is not None and rng.random() < 0.3:  # a tool loop: the same dispatch again
            agent, step, parent = state[:3]
        else:
            agent, step, parent = rng.choice(following[state[0]]), state[1] + 1, state[0]
        state[:3] = agent, step, parent
        state[3].extend(rng.randrange(10**5) for _ in range(rng.randint(8, 40)))
        tag = AgentTag(agent, session, parent, step) if rng.random() > 0.05 else None
        params = SamplingParams(max_tokens=1, extra_args=None if tag is None else tag.to_xargs())
        req = Request(f"r{seed}-{i}", anchors[agent] + state[3], params, None, block_hasher=HASHER, session_id=session)
        out.append((clock, req, ended, rng.random() < 0.4 if rng.random() < 0.5 else None))
    return out


def _copy(req: Request) -> Request:
    return Request(req.request_id, list(req.prompt_token_ids or []), req.sampling_params, None, block_hasher=HASHER,
                   session_id=req.session_id)


def _partitions_agree(queue: ScoredFreeBlockQueue[Hashable]) -> bool:
    indexed = [key for members in queue._partitions.values() for key in members]
    return sorted(map(repr, [*indexed, *queue._unpartitioned])) == sorted(map(repr, queue._groups))


@pytest.mark.parametrize(("seed", "max_ended"), [*((seed, 100_000) for seed in range(4)), (4, 3), (5, 3)])
def test_incremental_rescoring_evicts_as_a_full_rescoring(seed: int, max_ended: int) -> None:
    """Also across session events, which re-score only the sessions whose rates moved and those
    that ended or came back (``max_ended`` 3: an end forgets the oldest ended session, live again)."""
    clocks = [0.0, 0.0]
    managers: list[KVCacheManager] = [make_manager(300, BS, max_model_len=8192) for _ in range(2)]
    runtimes = [AgentKVRuntime(RuntimeConfig(), clock=lambda i=i: clocks[i]) for i in range(2)]
    for runtime, kv in zip(runtimes, managers, strict=True):
        runtime.install(kv)
        runtime.facts.ended.cap = max_ended
    incremental, full = runtimes
    rescored = 0
    for clock, req, ended, told in _workload(seed, 700):
        hits = []
        for i, (runtime, kv) in enumerate(zip(runtimes, managers, strict=True)):
            clocks[i] = clock
            if ended is not None:
                events = {"version": 1, "events": [{"type": "session_end", "session": ended}]}
                assert runtime.apply_events(events) == {"accepted": 1, "duplicates": 0}
            runtime.on_add_request(request := _copy(req) if i else req)
            if runtime is full:
                runtime._scored_table = None  # no earlier table: every group is re-scored
            runtime.refresh()
            hits.append(serve_once(kv, request) if kv.block_pool.get_num_free_blocks() > 80 else None)
            if told is not None and request.session_id is not None:
                runtime.answered(request.session_id, told)
        assert hits[0] == hits[1]
        queues = [runtime.queues[0] for runtime in runtimes]
        scores = [{key: group.score for key, group in queue._groups.items()} for queue in queues]
        assert scores[0] == scores[1]
        assert _partitions_agree(queues[0])
        rescored += incremental._scored_table is not None and incremental.policy == "survival"
    assert rescored > 100  # the incremental path ran
    orders = [[block.block_id for block in runtime.queues[0].popleft_n(runtime.queues[0].num_free_blocks)]
              for runtime in runtimes]
    assert orders[0] == orders[1]


class _Key:
    def __init__(self, session: str | None, name: str) -> None:
        self.session, self.name = session, name

    def __repr__(self) -> str:
        return f"{self.session}/{self.name}"


def _free_queue_of(keys: list[_Key], copies: int) -> tuple[ScoredFreeBlockQueue[_Key], dict[int, _Key]]:
    """A scored queue partitioned by session, holding ``copies`` free blocks of each key in turn
    (and by which key each block was filed)."""
    by_block: dict[int, _Key] = {}

    def group_of(block: KVCacheBlock) -> _Key:
        return by_block[block.block_id]

    pool = make_manager(20, BS).block_pool
    queue = ScoredFreeBlockQueue.replace(pool, group_of, partition_of=lambda key: key.session)
    blocks = queue.popleft_n(copies * len(keys))
    for i, block in enumerate(blocks):
        by_block[block.block_id] = keys[i % len(keys)]
    queue.append_n(blocks)
    return queue, by_block


def test_only_the_named_partitions_and_the_unpartitioned_groups_are_rescored() -> None:
    queue, by_block = _free_queue_of([_Key("s1", "x"), _Key("s1", "y"), _Key("s2", "x"), _Key(None, "anchor")], 2)
    queue.set_group_scores(lambda key: 1.0)
    queue.set_group_scores(lambda key: 2.0, changed_partitions={"s1"})
    assert {repr(key): group.score for key, group in queue._groups.items()} == {
        "s1/x": 2.0, "s1/y": 2.0, "s2/x": 1.0, "None/anchor": 2.0}
    # the heap follows: s2's blocks (score 1.0) go first, then the rest in append order
    popped = [by_block[block.block_id] for block in queue.popleft_n(queue.num_free_blocks)
              if block.block_id in by_block]
    assert [repr(key) for key in popped][:2] == ["s2/x", "s2/x"]
    assert not queue._partitions and not queue._unpartitioned and not queue._groups


def test_one_partition_is_rescored_by_the_current_scores() -> None:
    """``rescore_partition`` re-reads the score function for one partition's groups only (a
    session that dispatched); the anchors keep their scores."""
    queue, by_block = _free_queue_of([_Key("s1", "x"), _Key("s2", "x"), _Key(None, "anchor")], 2)
    scores = {"s1/x": 3.0, "s2/x": 2.0, "None/anchor": 1.0}
    queue.set_group_scores(lambda key: scores[repr(key)])
    scores.update({"s1/x": 0.0, "s2/x": 0.0, "None/anchor": 0.0})
    queue.rescore_partition("s1")
    queue.rescore_partition("gone")  # a session with no free blocks: nothing to do
    assert {repr(key): group.score for key, group in queue._groups.items()} == {
        "s1/x": 0.0, "s2/x": 2.0, "None/anchor": 1.0}
    popped = [repr(by_block[block.block_id]) for block in queue.popleft_n(queue.num_free_blocks)
              if block.block_id in by_block]
    assert popped == ["s1/x", "s1/x", "None/anchor", "None/anchor", "s2/x", "s2/x"]


def test_a_session_end_rescores_that_sessions_groups_and_not_every_cached_group() -> None:
    """A session event changes whether its session is retired and nothing else the scores depend on
    but the rates, so the refresh after it re-scores the sessions whose rates moved and the ended
    one (and the anchors). It re-scored every cached group: 1.5 ms per event at 2,000 groups."""
    clock = [0.0]
    kv = manager(800)
    runtime = AgentKVRuntime(RuntimeConfig(refresh_interval=0.0), clock=lambda: clock[0])
    runtime.install(kv)
    for _, _, tokens, tag in pipeline_sessions(12):
        run(kv, runtime, request(tokens, tag))
        clock[0] += 0.5
    queue = runtime.queues[0]
    histories = {key.session for key in queue._groups if type(key) is History}
    assert runtime.policy == "survival" and len(histories) == 12
    rescore, rescored = queue._rescore, []

    def spy(groups: Iterable[Any]) -> None:
        groups = list(groups)
        rescored.extend(group.key for group in groups)
        rescore(groups)

    queue._rescore = spy  # type: ignore[method-assign]
    assert runtime.apply_events({"version": 1, "events": [{"type": "session_end", "session": "s5"}]})["accepted"] == 1
    runtime.refresh()
    # the latest session is the only one still live (the others are idle beyond the learned gaps)
    assert {"s5"} <= {key.session for key in rescored if type(key) is History} <= {"s5", "s11"}
    assert all(group.score == -math.inf for key, group in queue._groups.items()
               if type(key) is History and key.session == "s5")
