"""Score-aware replacement for vLLM's ``FreeKVCacheBlockQueue``.

Installed by swapping ``BlockPool.free_block_queue`` (no fork): see
``ScoredFreeBlockQueue.replace``. Only the base queue's methods and
``num_free_blocks`` and ``KVCacheBlock.block_id`` / ``block_hash`` /
``prev_free_block`` / ``next_free_block`` are relied upon.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

K = TypeVar("K", bound=Hashable)  # group key, e.g. ("anchor", agents)

# Recency decay per clock unit (seconds for time.monotonic): a block's score
# halves every ln(2) / DEFAULT_DECAY ~ 42 s. The runtime's scores are in time
# resolutions (``ReuseTable.scorer(in_resolutions=True)``), so for it this is per
# resolution: ~42 resolutions, whatever the workload's time scale.
DEFAULT_DECAY = 1.0 / 60.0

# Heap compaction slack: stale entries are tolerated up to 2 * groups + this.
_HEAP_SLACK = 64


class _Group(Generic[K]):
    """Free tail-segment blocks of one group, FIFO by append sequence."""

    __slots__ = ("blocks", "index", "key", "partition", "score")

    def __init__(self, key: K, score: float) -> None:
        self.key = key
        self.score = score
        # block_id -> (block, seq, decay * t_free); insertion order == seq order.
        self.blocks: OrderedDict[int, tuple[KVCacheBlock, int, float]] = OrderedDict()
        # with partitions: the group's partition and the index it is in (its partition's or the unpartitioned)
        self.partition: Hashable | None = None
        self.index: dict[K, _Group[K]] | None = None


# (eviction key, seq of the group head it was computed for, group)
_HeapEntry = tuple[float, int, _Group[K]]


class ScoredFreeBlockQueue(FreeKVCacheBlockQueue, Generic[K]):
    """Free block queue that evicts cached blocks by group score, not pure LRU.

    Invariants:
    1. The base class's doubly linked list holds ALL free blocks in exactly
       vanilla order, so ``num_free_blocks``, ``get_all_free_blocks``,
       ``iter_blocks_after``, ``remove`` and ``prepend_n`` behave as in vLLM.
       The list is a front segment (initial blocks and ``prepend_n``: hash-less
       blocks, recycled first) followed by a tail segment (``append`` /
       ``append_n``, in append order, hash-less ``unpin_blocks`` ones included).
       When enabled, list order is NOT eviction order inside the tail (vLLM's
       simple_kv_offload lazy mode walks ``iter_blocks_after`` as if it were).
    2. Each tail-segment block belongs to exactly one group (``group_of`` is
       called once, when the block is appended; ``regroup`` may move it later,
       as if freed again) and has ``t_free = clock()`` and a globally
       increasing ``seq``. Front-segment blocks have no group.
    3. Eviction key of a tail block b in group g: ``(s_g + decay * t_free(b),
       seq(b))``, smallest first. It is log(p_g * exp(-decay * age)) plus the
       common term ``decay * now``, hence time-invariant. ``s_g = -inf``
       (retired) evicts first. Keys increase with seq inside a group as long
       as ``clock`` never goes backwards, so a group's head is its minimum.
    4. ``popleft`` takes the list head while the front segment is non-empty,
       otherwise the tail block with the smallest key. With ``enabled=False``
       it always takes the list head (vanilla); the groups are maintained
       either way, so ``enabled`` can be toggled at any time.
    5. With ``partition_of``, every group is in exactly one index: its partition's
       (``_partitions[partition_of(key)]``) or ``_unpartitioned``; a partition is
       listed only while it has a group.

    Consequences: with equal scores for all groups the pop order is exactly
    vanilla's (front, then tail in append order = LRU). A prefix chain never
    loses a parent before its children PROVIDED the parent's group score is
    >= the child's (the caller guarantees this): vLLM frees a chain in reverse
    in one ``append_n`` and a parent cannot be freed before its children, so
    the parent's ``t_free`` and ``seq`` are never smaller.

    Cost: append/remove O(1) + O(log heap) when a group head changes; popleft_n
    O(log heap) per run of blocks taken from one group (stale heap entries are
    skipped lazily and the heap is compacted); ``set_group_scores`` O(G) for G
    non-empty groups plus O(log heap) per group whose score changed, or, told
    which partitions changed, O(groups of those partitions + unpartitioned);
    ``rescore_partition`` O(groups of that partition).
    """

    def __init__(
        self,
        blocks: list[KVCacheBlock],
        group_of: Callable[[KVCacheBlock], K],
        *,
        clock: Callable[[], float] = time.monotonic,
        decay: float = DEFAULT_DECAY,
        partition_of: Callable[[K], Hashable | None] | None = None,
    ) -> None:
        """``blocks`` form the front segment; add tail blocks with append_n.

        ``partition_of(key)`` names the partition of a group (e.g. its session; None: none),
        so that ``set_group_scores`` can re-score only the partitions the caller says changed.
        """
        super().__init__(blocks)
        self.enabled = True
        # Called once per pop with the popped blocks and their runs of (group key, count), in
        # order (None: blocks of no group); those that still hold a hash are about to be evicted
        # by the pool.
        self.on_evict: Callable[[Sequence[KVCacheBlock], Sequence[tuple[K | None, int]]], None] | None = None
        self._group_of = group_of
        self._clock = clock
        self._decay = decay
        self._seq = 0
        self._score_of: Callable[[K], float] = lambda key: 0.0
        self._groups: dict[K, _Group[K]] = {}
        self._group_by_block: dict[int, _Group[K]] = {}
        self._heap: list[_HeapEntry[K]] = []
        self._partition_of = partition_of
        # partition -> its non-empty groups; groups whose partition is None are in ``_unpartitioned``
        self._partitions: dict[Hashable, dict[K, _Group[K]]] = {}
        self._unpartitioned: dict[K, _Group[K]] = {}

    @classmethod
    def replace(
        cls,
        pool: BlockPool,
        group_of: Callable[[KVCacheBlock], K],
        *,
        clock: Callable[[], float] = time.monotonic,
        decay: float = DEFAULT_DECAY,
        partition_of: Callable[[K], Hashable | None] | None = None,
    ) -> ScoredFreeBlockQueue[K]:
        """Install a scored queue on ``pool``, keeping its free list order.

        The leading run of hash-less blocks becomes the front segment; every
        later block joins the tail (vLLM only appends after the prepended run,
        so this reproduces the segments of a pool that was already used).
        """
        free = pool.free_block_queue.get_all_free_blocks()
        split = 0
        while split < len(free) and free[split].block_hash is None:
            split += 1
        queue = cls(free[:split], group_of, clock=clock, decay=decay, partition_of=partition_of)
        queue.append_n(free[split:])
        pool.free_block_queue = queue
        return queue

    def set_group_scores(
        self, scores: Mapping[K, float] | Callable[[K], float], default: float = 0.0,
        *, changed_partitions: Collection[Hashable] | None = None,
    ) -> None:
        """Set every group's log-space score; replaces, not merges.

        ``scores`` is a mapping (absent groups get ``default``) or a function of the
        group key, which also scores groups created later. ``-math.inf`` retires a
        group (evicted first). ``changed_partitions`` (needs ``partition_of``): the caller
        guarantees that every group of any other partition scores as before, so only
        these partitions' groups and the unpartitioned ones are re-scored.
        """
        if isinstance(scores, Mapping):
            table = dict(scores)
            self._score_of = lambda key: table.get(key, default)
        else:
            self._score_of = scores
        groups: Iterable[_Group[K]]
        if changed_partitions is None or self._partition_of is None:
            groups = self._groups.values()
        else:
            partitions = self._partitions
            groups = [*self._unpartitioned.values(),
                      *(g for p in changed_partitions if (members := partitions.get(p)) for g in members.values())]
        self._rescore(groups)

    def rescore_partition(self, partition: Hashable) -> None:
        """Re-score one partition's groups with the current scores (those of the others stand)."""
        members = self._partitions.get(partition)
        if members:
            self._rescore(members.values())  # re-scoring moves no group between partitions

    def _rescore(self, groups: Iterable[_Group[K]]) -> None:
        changed = []
        score_of = self._score_of
        for group in groups:
            score = score_of(group.key)
            if score != group.score:
                if score != score:  # NaN (unequal to every score, itself included)
                    raise ValueError(f"group score of {group.key!r} is NaN")
                group.score = score
                changed.append(group)
        if 4 * len(changed) > len(self._groups):
            self._rebuild_heap()
        elif changed:  # the old entries of changed groups go stale (their key no longer matches)
            heap, push = self._heap, heapq.heappush
            for group in changed:  # _push_head inlined, compacting once at the end
                _, seq, base = next(iter(group.blocks.values()))
                push(heap, (group.score + base, seq, group))
            if len(heap) > 2 * len(self._groups) + _HEAP_SLACK:
                self._rebuild_heap()

    def regroup(self, blocks: Iterable[KVCacheBlock], key: K) -> int:
        """File the tail-segment ones of ``blocks`` under group ``key`` as if freed now, e.g. blocks
        whose hash was dropped while they were free. List order is untouched. Returns how many
        blocks changed group."""
        grouped = self._group_by_block
        moved = [block for block in blocks if (group := grouped.get(block.block_id)) is not None and group.key != key]
        if moved:
            for block in moved:
                self._detach(block)
            self._file(moved, lambda block: key)
        return len(moved)

    # --- FreeKVCacheBlockQueue API -------------------------------------

    def popleft(self) -> KVCacheBlock:
        if not self.enabled:
            block = super().popleft()
            self._report_evictions((block,), ((self._detach(block), 1),))
            return block
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if not self.enabled:
            popped = super().popleft_n(n)
            self._report_evictions(popped, [(self._detach(block), 1) for block in popped])
            return popped
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} of {self.num_free_blocks} free blocks")
        head, grouped = self.fake_free_list_head, self._group_by_block
        ret: list[KVCacheBlock] = []
        runs: list[tuple[K | None, int]] = []
        remove = super().remove
        while len(ret) < n:
            first = head.next_free_block
            assert first is not None
            # The front segment is a prefix of the list: once the head is
            # grouped, only tail blocks are left and the key decides.
            if first.block_id in grouped:
                runs.append(self._pop_min_run(n - len(ret), ret))
            else:
                remove(first)
                ret.append(first)
                runs.append((None, 1))
        self._report_evictions(ret, runs)
        return ret

    def _report_evictions(self, popped: Sequence[KVCacheBlock], runs: Sequence[tuple[K | None, int]]) -> None:
        if self.on_evict is not None and popped:
            self.on_evict(popped, runs)

    def remove(self, block: KVCacheBlock) -> None:
        super().remove(block)
        self._detach(block)

    def append(self, block: KVCacheBlock) -> None:
        super().append(block)
        self._attach((block,))

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        super().append_n(blocks)
        self._attach(blocks)

    # prepend_n is inherited: prepended blocks are front segment, groupless.

    # --- side structures -------------------------------------------------

    def _attach(self, blocks: Sequence[KVCacheBlock]) -> None:
        if blocks:
            self._file(blocks, self._group_of)

    def _file(self, blocks: Iterable[KVCacheBlock], key_of: Callable[[KVCacheBlock], K]) -> None:
        """Add ``blocks`` to the groups ``key_of`` names, as freed now, in order."""
        # One clock read per batch: a chain freed together shares t_free, so
        # seq alone orders it (child before parent, as vLLM frees in reverse).
        base = self._decay * self._clock()
        groups, by_block = self._groups, self._group_by_block
        seq = self._seq
        key: K | None = None
        group: _Group[K] | None = None
        members: OrderedDict[int, tuple[KVCacheBlock, int, float]] = OrderedDict()
        new_head = False
        try:
            for block in blocks:
                block_key = key_of(block)
                if block_key is not key and (group is None or block_key != key):  # a batch's runs share a group
                    key = block_key
                    group = groups.get(key)
                    if group is None:
                        score = self._score_of(key)
                        if score != score:  # NaN (unequal to every score, itself included)
                            raise ValueError(f"group score of {key!r} is NaN")
                        group = groups[key] = _Group(key, score)
                        if self._partition_of is not None:
                            self._index(group)
                    members = group.blocks
                    new_head = not members
                seq += 1
                block_id = block.block_id
                members[block_id] = (block, seq, base)
                by_block[block_id] = group
                if new_head:  # this block heads its group: the heap needs its entry
                    self._push_head(group)  # type: ignore[arg-type]
                    new_head = False
        finally:
            self._seq = seq

    def _detach(self, block: KVCacheBlock) -> K | None:
        """Drop a block that just left the list from its group (if any); returns the group's key."""
        group = self._group_by_block.pop(block.block_id, None)
        if group is None:
            return None
        was_head = next(iter(group.blocks)) == block.block_id
        del group.blocks[block.block_id]
        if not group.blocks:
            self._drop(group)
        elif was_head:
            self._push_head(group)
        return group.key

    def _index(self, group: _Group[K]) -> None:
        partition = group.partition = self._partition_of(group.key)  # type: ignore[misc]
        index = group.index = self._unpartitioned if partition is None else self._partitions.setdefault(partition, {})
        index[group.key] = group

    def _drop(self, group: _Group[K]) -> None:
        """Forget a group that just lost its last block."""
        del self._groups[group.key]
        index = group.index
        if index is None:
            return
        del index[group.key]
        if not index and group.partition is not None:
            del self._partitions[group.partition]

    def _push_head(self, group: _Group[K]) -> None:
        heapq.heappush(self._heap, _head_entry(group))
        if len(self._heap) > 2 * len(self._groups) + _HEAP_SLACK:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        heap: list[_HeapEntry[K]] = []
        for group in self._groups.values():  # _head_entry inlined: this runs for every group
            _, seq, base = next(iter(group.blocks.values()))
            heap.append((group.score + base, seq, group))
        heapq.heapify(heap)
        self._heap = heap

    def _pop_min_run(self, limit: int, out: list[KVCacheBlock]) -> tuple[K, int]:
        """Unlink tail blocks in eviction-key order into ``out``, at most ``limit``; returns their
        group's key and how many.

        Takes a run from the group with the smallest key for as long as its next block
        still sorts before every other heap entry (a stale entry only ends a run early),
        so a group evicted in one go costs one heap operation, not one per block.
        """
        heap = self._heap
        while True:
            key, seq, group = heap[0]
            if group.blocks:
                _, head_seq, base = next(iter(group.blocks.values()))
                # Valid iff it still describes the head under the group's current score
                # (set_group_scores pushes a new entry when a score changes).
                if head_seq == seq and key == group.score + base:
                    break
            heapq.heappop(heap)
        # the run ends before the next block that sorts after the heap's second smallest entry
        size = len(heap)
        bound = (heap[1] if size == 2 or heap[1] < heap[2] else heap[2]) if size > 1 else None
        blocks, score, by_block = group.blocks, group.score, self._group_by_block
        taken = 0
        below = None  # the t_free term of the latest block whose key sorted below the bound's
        while blocks and taken < limit:
            block_id, entry = blocks.popitem(last=False)
            # (key, seq) > bound's (key, seq), without building the tuple; a block freed in the same
            # batch as one whose key sorted below the bound's shares that key (and t_free's float)
            if bound is not None and entry[2] is not below:
                key = score + entry[2]
                if taken and (key > bound[0] or (key == bound[0] and entry[1] > bound[1])):
                    blocks[block_id] = entry  # not this run's: back to the group's head
                    blocks.move_to_end(block_id, last=False)
                    break
                if key < bound[0]:
                    below = entry[2]
            del by_block[block_id]
            block = entry[0]
            # the base class's remove, inlined (a grouped block is listed)
            before, after = block.prev_free_block, block.next_free_block
            before.next_free_block = after  # type: ignore[union-attr]
            after.prev_free_block = before  # type: ignore[union-attr]
            block.prev_free_block = block.next_free_block = None
            out.append(block)
            taken += 1
        self.num_free_blocks -= taken
        if blocks:
            heapq.heapreplace(heap, _head_entry(group))
        else:
            heapq.heappop(heap)
            self._drop(group)
        return group.key, taken


def _head_entry(group: _Group[K]) -> _HeapEntry[K]:
    _, seq, base = next(iter(group.blocks.values()))
    return (group.score + base, seq, group)
