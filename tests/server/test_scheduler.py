"""agentkv's schedulers as the engine runs them: vLLM's own ``Scheduler`` and ``AsyncScheduler``
(the default on a GPU) with the extension, driven step by step through ``add_request``,
``schedule``, ``update_from_output`` and ``finish_requests``; the async one also pipelined as
vLLM's EngineCore runs it (the next step scheduled before the last one's output is in). No model
runs: each step's ``ModelRunnerOutput`` samples one token per scheduled request; every
scheduling, preemption and cache decision is vLLM's. The control channel is the real one
(``AGENTKV_CONTROL``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from agentkv.graph import TransitionLearner, save_snapshot
from agentkv.protocol import AgentTag
from server_patch._control import ask_blocking
from server_patch.scheduler import AgentKVAsyncScheduler, AgentKVScheduler

from .test_runtime import AGENTS, ANCHOR_BLOCKS, BS, HASHER, NUM_BLOCKS, anchor, pipeline_sessions

MAX_MODEL_LEN = 4096
SAMPLED = 7  # the token every step "samples"
# (agentkv's scheduler, vLLM's scheduler it extends, steps in flight as vLLM's EngineCore runs it)
KINDS = {"sync": (AgentKVScheduler, Scheduler, 1), "async": (AgentKVAsyncScheduler, AsyncScheduler, 2)}


@pytest.fixture
def control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """This test's own control endpoint (the server names it after the API-server process)."""
    endpoint = f"ipc://{tmp_path}/control.ipc"
    monkeypatch.setenv("AGENTKV_CONTROL", endpoint)
    return endpoint


@pytest.fixture
def make(tiny_model_dir: Path, control: str) -> Iterator:
    """make(cls, num_blocks): a scheduler of ``cls`` over a pool of ``num_blocks`` blocks (one of
    them vLLM's null block), shut down after the test."""
    made: list[Scheduler] = []

    def build(cls: type[Scheduler], num_blocks: int, *, prefix_caching: bool = True) -> Scheduler:
        config = VllmConfig(
            device_config=DeviceConfig(device="cpu"),  # vLLM infers no device where it finds no GPU
            model_config=ModelConfig(model=str(tiny_model_dir), dtype="bfloat16", seed=0,
                                     skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN,
                                             max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False,
                                             async_scheduling=issubclass(cls, AsyncScheduler)),
            cache_config=CacheConfig(block_size=BS, enable_prefix_caching=prefix_caching),
        )
        config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
        kv_cache = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                 kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        scheduler = cls(vllm_config=config, kv_cache_config=kv_cache, block_size=BS, log_stats=True,
                        structured_output_manager=StructuredOutputManager(config))
        made.append(scheduler)
        return scheduler

    yield build
    for scheduler in made:
        scheduler.shutdown()


def request(request_id: str, tokens: list[int], tag: AgentTag | None, max_tokens: int = 1) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=None if tag is None else tag.to_xargs())
    return Request(request_id, tokens, params, None, block_hasher=HASHER,
                   session_id=None if tag is None else tag.session)


def sampled(scheduled: SchedulerOutput) -> ModelRunnerOutput:
    """The model's output for a step: one token for every request scheduled."""
    ids = list(scheduled.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                             sampled_token_ids=[[SAMPLED] for _ in ids])


def step(scheduler: Scheduler) -> None:
    """One engine step: schedule, then apply the model's output."""
    scheduled = scheduler.schedule()
    scheduler.update_from_output(scheduled, sampled(scheduled))


def run(scheduler: Scheduler, in_flight: int) -> dict[str, int]:
    """Steps until every request finished, as ``EngineCore.step_with_batch_queue``: a new step is
    scheduled while fewer than ``in_flight`` are out and there is work, else the oldest one's
    output is applied. The prompt tokens each request found cached when first scheduled."""
    cached: dict[str, int] = {}
    out: deque[SchedulerOutput] = deque()
    for _ in range(1000):
        if not (scheduler.has_requests() or out):
            return cached
        if scheduler.has_requests():
            scheduled = scheduler.schedule()
            cached.update((new.req_id, new.num_computed_tokens) for new in scheduled.scheduled_new_reqs)
            out.append(scheduled)
            if len(out) < in_flight and (scheduled.total_num_scheduled_tokens > 0 or scheduler.has_requests()):
                continue
        done = out.popleft()
        scheduler.update_from_output(done, sampled(done))
    raise AssertionError("requests left after 1000 engine steps")


def replay(scheduler: Scheduler, in_flight: int, control: str | None, n_sessions: int,
           first: int = 0) -> list[tuple[str, int]]:
    """test_runtime's pipeline sessions, each ended over the control channel (agentkv only)."""
    hits = []
    for number, (session, agent, tokens, tag) in enumerate(pipeline_sessions(n_sessions, first=first)):
        scheduler.add_request(request(f"r{first}-{number}", tokens, tag))
        hits.append((session, run(scheduler, in_flight)[f"r{first}-{number}"]))
        if control is not None and agent == AGENTS[-1]:
            payload = {"version": 1, "events": [{"type": "session_end", "session": session}]}
            assert ask_blocking(control, {"op": "events", "payload": payload}) == {"accepted": 1, "duplicates": 0}
    return hits


def busy_sessions(scheduler: AgentKVScheduler) -> set[str]:
    """The sessions agentkv counts as waiting for a request of theirs (never idle)."""
    live = scheduler.agentkv.timing.live()
    return {name for name, seen in zip(live.names, live.seen, strict=True) if seen == math.inf}


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_scheduler_keeps_every_anchor_where_vllms_own_cycles_them_out(make, control, kind):
    ours, theirs, in_flight = KINDS[kind]
    vanilla = replay(make(theirs, NUM_BLOCKS), in_flight, None, 6)
    scheduler = make(ours, NUM_BLOCKS)
    scored = replay(scheduler, in_flight, control, 6)
    # from the third session on (anchors are learned from two sessions), every call hits its anchor
    assert [hit for session, hit in scored if session not in ("s0", "s1")] == [ANCHOR_BLOCKS * BS] * 16
    assert sum(hit for _, hit in vanilla) == 0  # the cyclic working set is larger than the cache
    stats = ask_blocking(control, {"op": "stats"})
    assert stats["policy"] == "survival" and stats["sessions"]["ended"] == 6
    assert stats["evictions"]["anchor"] == 0 < stats["evictions"]["retired"]
    assert busy_sessions(scheduler) == set()


def test_without_prefix_caching_eviction_stays_vllms_own(make, control):
    """``--no-enable-prefix-caching``: nothing is ever reused, so agentkv leaves the free queue to
    vLLM (and says so in its stats) while it still learns the agents' transitions."""
    scheduler = make(AgentKVScheduler, NUM_BLOCKS, prefix_caching=False)
    assert type(scheduler.kv_cache_manager.block_pool.free_block_queue) is FreeKVCacheBlockQueue
    hits = replay(scheduler, 1, control, 2)
    assert sum(hit for _, hit in hits) == 0
    stats = ask_blocking(control, {"op": "stats"})
    assert stats["enabled"] is False and stats["policy"] == "lru"
    assert set(stats["transitions"]["supervisor"]) == {"coder"}


def test_on_a_vllm_the_gate_refuses_the_opted_in_fallback_leaves_vllm_untouched(make, control, monkeypatch,
                                                                                 tmp_path):
    """``AGENTKV_ALLOW_LRU_FALLBACK=1`` on a vLLM the gate has not verified: no method of vLLM's is
    wrapped (one missing there must not break the engine), eviction is vLLM's own, nothing is
    learned, and a snapshot learned before is neither read nor overwritten."""
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    monkeypatch.setenv("AGENTKV_ALLOW_LRU_FALLBACK", "1")
    snapshot = tmp_path / "learned.json"
    snapshot.write_text("kept as it was")
    monkeypatch.setenv("AGENTKV_SNAPSHOT", str(snapshot))
    vanilla = replay(make(Scheduler, NUM_BLOCKS), 1, None, 3)
    scheduler = make(AgentKVScheduler, NUM_BLOCKS)
    manager = scheduler.kv_cache_manager
    assert type(manager.block_pool.free_block_queue) is FreeKVCacheBlockQueue
    assert not {"cache_full_blocks", "reset_prefix_cache"} & set(vars(manager.block_pool))
    assert not {"get_computed_blocks", "record_prefix_cache_stats", "free"} & set(vars(manager))
    assert replay(scheduler, 1, None, 3) == vanilla
    stats = ask_blocking(control, {"op": "stats"})
    assert stats["enabled"] is False and stats["policy"] == "lru" and stats["dispatches"] == 0
    scheduler.shutdown()
    assert snapshot.read_text() == "kept as it was"


def test_a_restored_snapshot_is_not_rewritten_by_an_engine_that_learned_nothing(make, monkeypatch, tmp_path):
    """The EngineCore's shutdown saved unconditionally, and a restored state counted as never saved:
    every stop rewrote the file it started from (after the middleware's save had, too)."""
    snapshot = tmp_path / "learned.json"
    learner = TransitionLearner()
    for agent in ("planner", "coder") * 3:
        learner.observe(agent, session="s")
    save_snapshot(snapshot, learner)
    written = snapshot.stat().st_ino  # a save writes a new file and renames it over the old one
    monkeypatch.setenv("AGENTKV_SNAPSHOT", str(snapshot))
    scheduler = make(AgentKVScheduler, NUM_BLOCKS)
    assert scheduler.agentkv.learner.agents == ["planner", "coder"]
    scheduler.shutdown()
    assert snapshot.stat().st_ino == written


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_view_reads_the_schedulers_queues(make, control, kind):
    scheduler = make(KINDS[kind][0], 64)
    queued = request("queued", list(range(100, 100 + 3 * BS)), AgentTag("coder", "s", "", 0), max_tokens=4)
    scheduler.add_request(queued)
    assert ask_blocking(control, {"op": "view"})["waiting"] == 1
    step(scheduler)
    view = ask_blocking(control, {"op": "view"})
    assert (view["waiting"], view["running"]) == (0, 1)
    assert busy_sessions(scheduler) == {"s"}
    while not queued.is_finished():
        step(scheduler)
    assert busy_sessions(scheduler) == set()


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_aborted_request_no_longer_keeps_its_session_busy(make, kind):
    scheduler = make(KINDS[kind][0], 64)
    running = request("gone", list(range(200, 200 + 3 * BS)), AgentTag("coder", "left", "", 0), max_tokens=50)
    scheduler.add_request(running)
    step(scheduler)
    step(scheduler)
    assert busy_sessions(scheduler) == {"left"}
    scheduler.finish_requests("gone", RequestStatus.FINISHED_ABORTED)  # the client went away
    assert busy_sessions(scheduler) == set()
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_preempted_request_keeps_its_session_busy_until_it_finishes(make, kind):
    # 10 usable blocks; two requests of 3 prompt blocks decoding 60 tokens (4 more blocks each):
    # the pool runs out while both decode and vLLM preempts the later one (frees its blocks)
    scheduler = make(KINDS[kind][0], 11)
    first = request("first", list(range(300, 300 + 3 * BS)), AgentTag("coder", "one", "", 0), max_tokens=60)
    second = request("second", list(range(400, 400 + 3 * BS)), AgentTag("coder", "two", "", 0), max_tokens=60)
    scheduler.add_request(first)
    scheduler.add_request(second)
    preempted = False
    for _ in range(400):
        step(scheduler)
        preempted |= second.num_preemptions > 0
        if preempted and not second.is_finished():
            assert "two" in busy_sessions(scheduler)  # freed, yet queued again: not idle
        if first.is_finished() and second.is_finished():
            break
    assert preempted and first.is_finished() and second.is_finished()
    assert busy_sessions(scheduler) == set()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_reset_that_preempts_the_running_requests_leaves_no_old_block_in_the_way(make, control, kind):
    # what /reset_prefix_cache?reset_running_requests=true and /sleep do: preempt what runs, drop
    # every hash; the free queue's blocks that held anchors are worthless from then on
    ours, _, in_flight = KINDS[kind]
    scheduler = make(ours, NUM_BLOCKS)
    replay(scheduler, in_flight, control, 3)
    running = request("long", anchor("coder") + list(range(90_000, 90_000 + 2 * BS)), AgentTag("coder", "late", "", 0),
                      max_tokens=20)
    scheduler.add_request(running)
    step(scheduler)
    step(scheduler)
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert running.num_preemptions == 1
    while not running.is_finished():
        step(scheduler)
    assert busy_sessions(scheduler) == set()
    hits = replay(scheduler, in_flight, control, 4, first=3)
    # the first session after it recomputes its anchors; from the next on every call hits them
    assert [hit for session, hit in hits if session != "s3"] == [ANCHOR_BLOCKS * BS] * 12
    assert ask_blocking(control, {"op": "stats"})["evictions"]["anchor"] == 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_preempted_request_admitted_again_is_counted_once(make, control, kind):
    # a reset that preempts what runs (/reset_prefix_cache?reset_running_requests=true) puts a
    # warm-up and a real call back in the queue: admitted again, neither is a new call
    scheduler = make(KINDS[kind][0], NUM_BLOCKS)
    warmup = request("warm", anchor("coder"), AgentTag("coder", "w", "", 0, warmup=True), max_tokens=20)
    call = request("call", anchor("writer") + list(range(90_000, 90_000 + 2 * BS)), AgentTag("writer", "s", "", 0),
                   max_tokens=20)
    scheduler.add_request(warmup)
    scheduler.add_request(call)
    step(scheduler)
    step(scheduler)
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert warmup.num_preemptions == call.num_preemptions == 1
    while not (warmup.is_finished() and call.is_finished()):
        step(scheduler)
    stats = ask_blocking(control, {"op": "stats"})
    assert stats["warmups"]["sent"] == 1
    assert stats["agents"]["writer"]["queries"] == call.num_prompt_tokens  # vLLM's count: once
