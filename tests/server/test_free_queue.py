"""ScoredFreeBlockQueue on real vLLM BlockPool / KVCacheManager objects."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.request import Request

from agentkv.bench import kv_manager
from server_patch._free_queue import ScoredFreeBlockQueue
from server_patch._runtime import AgentKVRuntime, RuntimeConfig

K = TypeVar("K", bound=Hashable)

BS = 16
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


class Clock:
    """Manual clock so t_free is deterministic."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Tags:
    """group_of callback: block_id -> group, filled in by the test."""

    def __init__(self, default: Hashable = "untagged") -> None:
        self.by_block: dict[int, Hashable] = {}
        self.default = default

    def tag(self, block_ids: list[int], group: Hashable) -> None:
        for bid in block_ids:
            self.by_block.setdefault(bid, group)

    def __call__(self, block: KVCacheBlock) -> Hashable:
        return self.by_block.get(block.block_id, self.default)


def make_manager(num_blocks: int) -> KVCacheManager:
    return kv_manager.make_manager(num_blocks, BS, max_model_len=8192)


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=HASHER)


def allocate(manager: KVCacheManager, req: Request) -> tuple[list[int], int] | None:
    """Prefill ``req`` (prefix hit + new blocks); (all block ids, hit tokens)."""
    computed, num_hit, _ = manager.get_computed_blocks(req)
    new = manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, computed)
    if new is None:
        return None
    req.num_computed_tokens = req.num_tokens
    return list(manager.get_block_ids(req.request_id)[0]), num_hit


def free_ids(manager: KVCacheManager) -> list[int]:
    return [
        b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()
    ]


def toks(start: int, n_blocks: int, extra: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS + extra))


def install(
    manager: KVCacheManager, group_of: Callable[[KVCacheBlock], K], clock: Clock
) -> ScoredFreeBlockQueue[K]:
    return ScoredFreeBlockQueue.replace(
        manager.block_pool, group_of, clock=clock, decay=0.5
    )


def check_segments(queue: ScoredFreeBlockQueue[Any]) -> None:
    """Grouped (tail) blocks are exactly the list after a groupless prefix."""
    grouped = [b.block_id in queue._group_by_block for b in queue.get_all_free_blocks()]
    assert grouped == sorted(grouped)
    assert sum(grouped) == len(queue._group_by_block)
    assert sum(len(g.blocks) for g in queue._groups.values()) == sum(grouped)


def test_exact_victim_order_under_scoring() -> None:
    manager = make_manager(11)
    clock, tags = Clock(), Tags()
    queue = install(manager, tags, clock)
    reqs = {
        "a": make_request("a", toks(0, 3)),
        "b": make_request("b", toks(1000, 3)),
        "c": make_request("c", toks(2000, 3)),
    }
    for group, req in reqs.items():
        result = allocate(manager, req)
        assert result is not None
        tags.tag(result[0], group)
    ids = [manager.get_block_ids(r)[0] for r in "abc"]
    assert ids == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    for t, req in enumerate(reqs.values()):
        clock.t = float(t)
        manager.free(req)
    # Vanilla list order is kept: block 10 never used, then LRU tail.
    assert free_ids(manager) == [10, 3, 2, 1, 6, 5, 4, 9, 8, 7]

    # keys: a = 2.0 + 0.5*0 = 2.0, b = 0.0 + 0.5*1 = 0.5, c = 1.2 + 0.5*2 = 2.2
    queue.set_group_scores({"a": 2.0, "b": 0.0, "c": 1.2})
    check_segments(queue)
    got = manager.block_pool.get_new_blocks(5)
    assert [b.block_id for b in got] == [10, 6, 5, 4, 3]
    # The linked list is still the vanilla order minus the popped blocks.
    assert free_ids(manager) == [2, 1, 9, 8, 7]
    # Evicted blocks lost their hash; a's prefix [1, 2] is still a hit.
    assert all(b.block_hash is None for b in got)
    hit = make_request("a2", toks(0, 3))
    assert manager.get_computed_blocks(hit)[1] == 2 * BS

    # Re-scoring replaces all scores at once: c (key 4.0) is now cheapest.
    queue.set_group_scores({"c": 3.0}, default=5.0)  # a: 2.0 -> 5.0
    assert [b.block_id for b in manager.block_pool.get_new_blocks(4)] == [9, 8, 7, 2]
    check_segments(queue)


def _equal_score_workload(
    manager: KVCacheManager, clock: Clock, tags: Tags | None
) -> list[object]:
    """Shared prefixes, hits, interleaved frees, eviction; returns observations."""
    rng = random.Random(7)
    prefixes = [toks(10_000 * (i + 1), 3) for i in range(3)]
    live: list[Request] = []
    seen: list[object] = []
    for step in range(120):
        clock.t = float(step)
        if live and (rng.random() < 0.4 or len(live) > 4):
            manager.free(live.pop(rng.randrange(len(live))))
        else:
            p = rng.randrange(3)
            prompt = prefixes[p][: rng.randrange(1, 4) * BS]
            prompt += toks(
                100 * step + 1_000_000, rng.randrange(0, 3), rng.randrange(BS)
            )
            req = make_request(f"r{step}", prompt)
            result = allocate(manager, req)
            if result is not None:
                live.append(req)
                if tags is not None:
                    tags.tag(result[0], ("agent", p))
            seen.append(result)
        seen.append(free_ids(manager))
    return seen


def test_equal_scores_match_vanilla() -> None:
    vanilla = _equal_score_workload(make_manager(24), Clock(), None)

    manager, clock, tags = make_manager(24), Clock(), Tags(default=("agent", "x"))
    queue = install(manager, tags, clock)
    # Several groups, all with the same score, and a clock that moves.
    queue.set_group_scores({("agent", p): 3.0 for p in range(3)}, default=3.0)
    scored = _equal_score_workload(manager, clock, tags)
    assert scored == vanilla
    assert len(queue._groups) > 1
    check_segments(queue)


def test_retired_group_first_front_still_first() -> None:
    pool = BlockPool(num_gpu_blocks=12, enable_caching=True, hash_block_size=BS)
    clock, tags = Clock(), Tags()
    queue = ScoredFreeBlockQueue.replace(pool, tags, clock=clock, decay=0.5)

    def cached(rid: str, start: int, group: str) -> list[KVCacheBlock]:
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(make_request(rid, toks(start, 2)), blocks, 0, 2, BS, 0)
        tags.tag([b.block_id for b in blocks], group)
        return blocks

    live = cached("live", 0, "live")  # [1, 2]
    unpinned = pool.get_new_blocks(2)  # [3, 4], hash-less
    tags.tag([b.block_id for b in unpinned], "unpinned")
    retired = cached("retired", 100, "retired")  # [5, 6]
    scratch = pool.get_new_blocks(1)  # [7], hash-less
    all_ids = [b.block_id for b in live + unpinned + retired + scratch]
    assert all_ids == list(range(1, 8))

    pool.free_blocks(reversed(live))  # t=0, tail
    clock.t = 1.0
    pool.unpin_blocks(unpinned, lambda _b: None)  # hash-less, but tail
    clock.t = 2.0
    pool.free_blocks(reversed(retired))  # t=2, tail, freshest
    pool.free_blocks(scratch)  # hash-less: front
    assert free_ids_pool(pool) == [7, 8, 9, 10, 11, 2, 1, 3, 4, 6, 5]
    check_segments(queue)

    queue.set_group_scores({"retired": -math.inf})
    order = [b.block_id for b in pool.get_new_blocks(11)]
    # Front (vanilla head) first, then the retired group, then LRU.
    assert order == [7, 8, 9, 10, 11, 6, 5, 2, 1, 3, 4]
    assert queue.num_free_blocks == 0 and not queue._groups


def test_regroup_moves_free_blocks_without_touching_list_order() -> None:
    pool = BlockPool(num_gpu_blocks=9, enable_caching=True, hash_block_size=BS)
    clock, tags = Clock(), Tags()
    queue = ScoredFreeBlockQueue.replace(pool, tags, clock=clock, decay=0.5)
    blocks = pool.get_new_blocks(8)  # [1..8]
    for index, start in enumerate(range(0, 8, 2)):  # four groups of two, freed one after the other
        pair = blocks[start:start + 2]
        pool.cache_full_blocks(make_request(f"r{index}", toks(100 * index, 2)), pair, 0, 2, BS, 0)
        tags.tag([b.block_id for b in pair], f"g{index}")
        pool.free_blocks(reversed(pair))
        clock.t += 1.0
    listed = free_ids_pool(pool)
    assert listed == [2, 1, 4, 3, 6, 5, 8, 7]
    queue.set_group_scores({"g0": 1.0, "g1": 1.0, "g2": 1.0, "g3": 1.0, "gone": -math.inf})
    # blocks 4 and 6 (of g1, g2) move; an ungrouped or already moved block is left alone
    assert queue.regroup([pool.blocks[4], pool.blocks[6], pool.blocks[0]], "gone") == 2
    assert queue.regroup([pool.blocks[4]], "gone") == 0
    check_segments(queue)
    assert free_ids_pool(pool) == listed
    order = [b.block_id for b in pool.get_new_blocks(8)]
    assert order == [4, 6, 2, 1, 3, 5, 8, 7]  # the moved ones first, in the order given; then LRU
    assert queue.num_free_blocks == 0 and not queue._groups


def free_ids_pool(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_chain_evicted_child_before_parent() -> None:
    manager = make_manager(12)
    clock, tags = Clock(), Tags()
    queue = install(manager, tags, clock)
    pool = manager.block_pool

    # r1 [1,2,3,4]; r2 hits [1,2] and owns [5,6]; all in one group "s".
    r1, r2 = (
        make_request("r1", toks(0, 4)),
        make_request("r2", toks(0, 2) + toks(500, 2)),
    )
    for req in (r1, r2):
        result = allocate(manager, req)
        assert result is not None
        tags.tag(result[0], "s")
    assert manager.get_block_ids("r2")[0] == [1, 2, 5, 6]
    # An anchor chain (high score) whose suffix is cheap history.
    anchor = make_request("anchor", toks(900, 2) + toks(950, 2))
    result = allocate(manager, anchor)
    assert result is not None and result[0] == [7, 8, 9, 10]
    tags.tag([7, 8], "anchor")
    tags.tag([9, 10], "history")

    manager.free(r1)  # t=0: 4, 3 (1, 2 still held by r2)
    clock.t = 1.0
    manager.free(r2)  # t=1: 6, 5, 2, 1
    clock.t = 2.0
    manager.free(anchor)  # t=2: 10, 9 (history), 8, 7 (anchor)
    assert free_ids(manager) == [11, 4, 3, 6, 5, 2, 1, 10, 9, 8, 7]
    queue.set_group_scores({"anchor": 10.0, "history": 0.0, "s": 0.0})

    chains = [r1.block_hashes, r2.block_hashes, anchor.block_hashes]
    order = []
    for _ in range(11):
        order.append(pool.get_new_blocks(1)[0].block_id)
        for hashes in chains:
            hit = [pool.get_cached_block(h, [0]) is not None for h in hashes]
            assert hit == sorted(hit, reverse=True), "child outlived its parent"
    # History (key 1.0) ties with s's t=1 blocks and was appended later.
    assert order == [11, 4, 3, 6, 5, 2, 1, 10, 9, 8, 7]


def test_replace_on_used_pool() -> None:
    """Installing mid-run keeps the list and, with equal scores, the order."""
    managers = [make_manager(14), make_manager(14)]
    for m in managers:
        for i, extra in enumerate([5, 0, 9]):
            req = make_request(f"u{i}", toks(1000 * i, 3, extra))
            assert allocate(m, req) is not None
            if i != 1:
                m.free(req)
    vanilla, used = managers
    before = free_ids(used)
    queue = ScoredFreeBlockQueue.replace(used.block_pool, lambda b: b.block_id % 3)
    assert free_ids(used) == before == free_ids(vanilla)
    check_segments(queue)
    assert 0 < len(queue._group_by_block) < len(before)  # both segments exist
    queue.set_group_scores({}, default=1.0)
    n = len(before)
    got = [b.block_id for b in used.block_pool.get_new_blocks(n)]
    assert got == [b.block_id for b in vanilla.block_pool.get_new_blocks(n)]


def test_heap_stays_bounded_under_hits() -> None:
    """Cache hits on group heads leave stale heap entries; they are compacted."""
    pool = BlockPool(num_gpu_blocks=9, enable_caching=True, hash_block_size=BS)
    clock = Clock()
    queue = ScoredFreeBlockQueue.replace(pool, lambda b: b.block_id % 2, clock=clock)
    blocks = pool.get_new_blocks(8)
    pool.cache_full_blocks(make_request("h", toks(0, 8)), blocks, 0, 8, BS, 0)
    pool.free_blocks(blocks)
    for i in range(500):
        clock.t = float(i)
        head = blocks[i % 8]
        pool.touch([head])  # removes it from the queue (a head, often)
        pool.free_blocks([head])  # back to the tail of its group
    assert len(queue._heap) <= 2 * len(queue._groups) + 64
    queue.set_group_scores({1: -1.0})
    order = [b.block_id for b in pool.get_new_blocks(8)]
    assert order == [5, 7, 1, 3, 6, 8, 2, 4]


# --- differential property test ------------------------------------------

PREFIXES = [toks(50_000 * (i + 1), 4) for i in range(3)]

op_strategy = st.one_of(
    st.tuples(
        st.just("alloc"),
        st.integers(0, len(PREFIXES) - 1),  # shared prefix
        st.integers(0, 4 * BS),  # prefix tokens taken
        st.integers(1, 3 * BS),  # private suffix tokens
    ),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 2 * BS)),
)


@dataclass
class Replica:
    manager: KVCacheManager
    queue: ScoredFreeBlockQueue[Any] | None = None
    live: list[Request] = field(default_factory=list)
    runtime: AgentKVRuntime | None = None


def _replicas(clock: Clock) -> list[Replica]:
    vanilla = Replica(make_manager(16))

    disabled = Replica(make_manager(16))
    disabled.queue = install(disabled.manager, lambda b: b.block_id % 3, clock)
    disabled.queue.set_group_scores({0: -math.inf, 1: 4.0})  # must be ignored
    disabled.queue.enabled = False

    constant = Replica(make_manager(16))
    constant.queue = install(constant.manager, lambda b: "all", clock)
    constant.queue.set_group_scores({"all": 1.0})

    equal = Replica(make_manager(16))
    equal.queue = install(equal.manager, lambda b: b.block_id % 4, clock)
    equal.queue.set_group_scores({}, default=-2.0)

    # The whole server-side runtime, installed disabled and enabled without metadata (and without
    # recognition, which would find agents and sessions in these prompts and rank them).
    runtimes = []
    for enabled in (False, True):
        config = RuntimeConfig(enabled=enabled, recognize=False)
        rep = Replica(make_manager(16), runtime=AgentKVRuntime(config, clock=clock))
        rep.runtime.install(rep.manager)
        rep.queue = rep.runtime.queues[0] if enabled else None
        runtimes.append(rep)
    return [vanilla, disabled, constant, equal, *runtimes]


def _apply(rep: Replica, op: tuple[object, ...], step: int) -> object:
    if op[0] == "alloc":
        _, p, k, n = op
        assert isinstance(p, int) and isinstance(k, int) and isinstance(n, int)
        req = make_request(
            f"q{step}", PREFIXES[p][:k] + toks(1_000_000 + 1000 * step, 0, n)
        )
        if rep.runtime is not None:  # as the scheduler: learn the request, refresh, then allocate
            rep.runtime.on_add_request(req)
            rep.runtime.refresh()
        result = allocate(rep.manager, req)
        if result is not None:
            rep.live.append(req)
        return result
    if not rep.live:
        return None
    assert isinstance(op[1], int)
    req = rep.live[op[1] % len(rep.live)]
    if op[0] == "free":
        rep.manager.free(req)
        rep.live.remove(req)
        return None
    assert isinstance(op[2], int)
    req.append_output_token_ids(list(range(7, 7 + op[2])))
    new = rep.manager.allocate_slots(req, op[2])
    if new is None:
        req._all_token_ids[-op[2] :] = []  # undo the unscheduled growth
        req._output_token_ids[-op[2] :] = []
        del req.block_hashes[req.num_tokens // BS :]
        return None
    req.num_computed_tokens = req.num_tokens
    return new.get_block_ids()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
    database=None,
)
@given(st.lists(op_strategy, min_size=15, max_size=60))
def test_differential_against_vanilla(ops: list[tuple[object, ...]]) -> None:
    clock = Clock()
    replicas = _replicas(clock)
    for step, op in enumerate(ops):
        clock.t = float(step)
        results = [_apply(rep, op, step) for rep in replicas]
        assert all(r == results[0] for r in results), (op, results)
        orders = [free_ids(rep.manager) for rep in replicas]
        assert all(o == orders[0] for o in orders), (op, orders)
        for rep in replicas:
            if rep.queue is not None:
                check_segments(rep.queue)


@pytest.mark.parametrize("enabled", [True, False])
def test_toggle_keeps_structures(enabled: bool) -> None:
    """Flipping ``enabled`` mid-run needs no rebuild: the scored order after
    re-enabling is front segment, then tail by (group score, append order)."""
    manager = make_manager(11)
    queue = install(manager, lambda b: b.block_id % 2, Clock())
    scores = {0: 0.0, 1: 9.0}
    queue.set_group_scores(scores)
    for i in range(4):
        queue.enabled = enabled if i % 2 == 0 else not enabled
        req = make_request(f"t{i}", toks(100 * i, 3, 5))  # + hash-less tail
        assert allocate(manager, req) is not None
        manager.free(req)
        check_segments(queue)
    ids = free_ids(manager)
    n_front = sum(b not in queue._group_by_block for b in ids)
    assert n_front > 0
    lru = ids[n_front] % 2  # group of the LRU tail block: make it expensive
    scores = {lru: 9.0, 1 - lru: 0.0}
    queue.set_group_scores(scores)
    # Disabled: plain list head, also for single popleft() calls.
    queue.enabled = False
    assert [queue.popleft().block_id for _ in range(n_front + 1)] == ids[: n_front + 1]
    check_segments(queue)
    rest = ids[n_front + 1 :]
    queue.enabled = True
    order = [b.block_id for b in manager.block_pool.get_new_blocks(len(rest))]
    assert order == sorted(rest, key=lambda b: (scores[b % 2], ids.index(b)))
    assert order != rest and not queue._groups


def test_nan_score_is_refused_and_evictions_are_reported_once_per_pop() -> None:
    manager = make_manager(9)
    clock, tags = Clock(), Tags()
    queue = install(manager, tags, clock)
    reports: list[list[int]] = []
    runs: list[list[tuple[object, int]]] = []
    queue.on_evict = lambda blocks, groups: (reports.append([b.block_id for b in blocks]), runs.append(list(groups)))
    for rid, start in (("a", 0), ("b", 1000)):
        req = make_request(rid, toks(start, 3))
        result = allocate(manager, req)
        assert result is not None
        tags.tag(result[0], rid)
        manager.free(req)
    with pytest.raises(ValueError, match="NaN"):
        queue.set_group_scores({"a": math.nan})
    queue.set_group_scores({"a": 1.0, "b": 0.0})
    assert reports == [[1, 2, 3], [4, 5, 6]]  # the allocations' pops
    assert [b.block_id for b in queue.popleft_n(5)] == [7, 8, 6, 5, 4]
    assert reports[2:] == [[7, 8, 6, 5, 4]]  # one call with every popped block, cached or not
    assert runs[2:] == [[(None, 1), (None, 1), ("b", 3)]]  # with their groups' runs (none: front segment)


# --- property test: scored pop order against a brute-force reference ---------------

queue_op = st.one_of(
    st.tuples(st.just("free"), st.integers(1, 12), st.integers(0, 3)),  # a batch of n blocks of one group
    st.tuples(st.just("mixed"), st.lists(st.integers(0, 3), min_size=1, max_size=8)),  # one block per group named
    st.tuples(st.just("hit"), st.integers(0, 10_000)),  # a free tail block taken out (a prefix hit)
    st.tuples(st.just("score"), st.lists(st.sampled_from([-math.inf, -2.0, 0.0, 0.5, 3.0]), min_size=4, max_size=4)),
    st.tuples(st.just("pop"), st.integers(1, 10)),
    st.tuples(st.just("regroup"), st.integers(0, 10_000), st.integers(0, 3)),  # up to 3 tail blocks, as freed now
)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(queue_op, min_size=10, max_size=120))
def test_pops_follow_the_eviction_key_exactly(ops: list[tuple[object, ...]]) -> None:
    """Every pop takes the blocks of smallest (score + decay * t_free, seq), whatever hits took
    out of the middle of groups or ``regroup`` moved before; the front segment goes first, in list order."""
    blocks = [KVCacheBlock(i) for i in range(80)]
    clock, groups = Clock(), {}
    queue: ScoredFreeBlockQueue[int] = ScoredFreeBlockQueue(blocks[:4], lambda b: groups[b.block_id],
                                                            clock=clock, decay=0.5)
    front, in_use = [b.block_id for b in blocks[:4]], [b.block_id for b in blocks[4:]]
    scores, seq, tail = [0.0] * 4, 0, {}  # tail: block id -> (group, t_free, seq)
    for step, op in enumerate(ops):
        clock.t = float(step)
        if op[0] in ("free", "mixed"):
            named = [op[2]] * op[1] if op[0] == "free" else op[1]  # type: ignore[operator]
            batch = in_use[: len(named)]
            del in_use[: len(batch)]
            for block_id, group in zip(batch, named, strict=False):
                groups[block_id] = group
                seq += 1
                tail[block_id] = (group, clock.t, seq)
            queue.append_n([blocks[i] for i in batch])
        elif op[0] == "hit" and tail:
            block_id = sorted(tail)[op[1] % len(tail)]  # type: ignore[operator]
            queue.remove(blocks[block_id])
            del tail[block_id]
            in_use.append(block_id)
        elif op[0] == "regroup" and tail:
            start = op[1] % len(tail)  # type: ignore[operator]
            chosen = sorted(tail)[start : start + 3]
            queue.regroup([blocks[i] for i in chosen], op[2])
            for block_id in chosen:
                if tail[block_id][0] != op[2]:
                    seq += 1
                    tail[block_id] = (op[2], clock.t, seq)
        elif op[0] == "score":
            scores = list(op[1])  # type: ignore[arg-type]
            queue.set_group_scores(dict(enumerate(scores)))
        elif op[0] == "pop":
            count = min(op[1], len(front) + len(tail))  # type: ignore[type-var]
            expected = front[:count]
            order = sorted(tail, key=lambda b: (scores[tail[b][0]] + 0.5 * tail[b][1], tail[b][2]))
            expected += order[: count - len(expected)]
            assert [b.block_id for b in queue.popleft_n(count)] == expected
            del front[: len(expected)]
            for block_id in expected:
                tail.pop(block_id, None)
            in_use.extend(expected)
        assert queue.num_free_blocks == len(front) + len(tail)
        check_segments(queue)


def test_a_prefix_shared_by_many_agents_outlives_the_child_of_any_of_them():
    """A block shared by 24 agents (a common preamble) names them all: with 16 at most, a 17th,
    busy agent's own next block (its child) scored above it and the parent was evicted first,
    leaving the child unreachable ("a chain loses children before parents")."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from agentkv.graph import Predictor, ReuseConfig, SessionTiming, TransitionLearner, score_reuse
    from agentkv.protocol import AgentTag
    from server_patch._tracker import BlockTracker

    agents = [f"w{i}" for i in range(23)] + ["hot"]
    parent, child = KVCacheBlock(1), KVCacheBlock(2)
    parent._block_hash, child._block_hash = b"p", b"q"
    tracker = BlockTracker()
    tracker.cached([parent], 0, 1, AgentTag("w0", "s-w0"), anchor_blocks=2)
    for agent in agents[1:]:  # each other agent's first call hits the shared block
        tracker.hit([parent], AgentTag(agent, f"s-{agent}"), anchor_blocks=2)
    tracker.cached([parent, child], 1, 2, AgentTag("hot", "s-hot"), anchor_blocks=2)
    assert tracker.group_of(parent).agents == frozenset(agents)
    learner, timing = TransitionLearner(), SessionTiming()
    for i in range(40):  # "hot" loops on itself; the others start a session now and then
        for step in range(6):
            learner.observe("hot", session=f"h{i}", parent="" if step == 0 else None, now=0.0)
    for agent in agents[:-1]:
        learner.observe(agent, session=f"r-{agent}", parent="", now=0.0)
    for n in range(200):
        timing.observe("warm", "hot", n * 1.0)
    table = score_reuse(Predictor(learner).chain(), timing.table(), [("s-hot", "hot", 100.0)], now=100.2,
                        session_start_rate=0.01, continuation={}, interposed=None,
                        predictability=learner.predictability(), gap_count=timing.gaps, config=ReuseConfig())
    queue = ScoredFreeBlockQueue([], tracker.group_of, clock=lambda: 0.0)
    queue.set_group_scores(table.scorer())
    queue.append_n([child, parent])  # vLLM frees a chain's child first, in one batch
    assert queue.popleft_n(1) == [child]
