"""Recognition inside AgentKVRuntime on a real vLLM KVCacheManager (untagged requests get agents)."""

from __future__ import annotations

import itertools
import random

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from agentkv.protocol import AgentTag
from server_patch._runtime import AgentKVRuntime, RuntimeConfig
from tests.server.test_runtime import HASHER, manager, run

AGENTS = ("supervisor", "coder", "reviewer")
_ids = itertools.count()


def tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30_000) for _ in range(n)]


ANCHORS = {a: tokens("team", 40) + tokens(f"anchor-{a}", 90) for a in AGENTS}


def untagged(prompt: list[int], session_id: str | None = None) -> Request:
    return Request(f"u{next(_ids)}", prompt, SamplingParams(max_tokens=1), None, block_hasher=HASHER,
                   session_id=session_id)


def sessions(runtime: AgentKVRuntime, kv, count: int, *, first: int = 0) -> list[tuple[str, Request]]:
    """Pipeline sessions without tags: each agent's anchor + the session's growing history."""
    out = []
    for s in range(first, first + count):
        history = tokens(f"task-{s}", 50)
        for agent in AGENTS:
            req = untagged(ANCHORS[agent] + history)
            run(kv, runtime, req)
            out.append((agent, req))
            history = history + tokens(f"out-{s}-{agent}", 40)
    return out


def agent_only(prompt: list[int], agent: str) -> Request:
    params = SamplingParams(max_tokens=1, extra_args=AgentTag(agent).to_xargs())
    return Request(f"a{next(_ids)}", prompt, params, None, block_hasher=HASHER)


def test_requests_that_name_their_agent_and_no_session_get_the_session_of_the_conversation_they_continue():
    """Tagged with the agent alone: recognition finds the session (the pipeline conversation each
    request extends, named after the tagged agents); the tags' agents stay as they are."""
    runtime, kv = AgentKVRuntime(), manager(400)
    runtime.install(kv)
    tags = []
    for s in range(8):
        history = tokens(f"task-{s}", 50)
        for agent in AGENTS:
            req = agent_only(ANCHORS[agent] + history, agent)
            run(kv, runtime, req)
            tags.append(runtime.tag_of(req))
            history = history + tokens(f"out-{s}-{agent}", 40)
    measured = tags[12:]  # once the agents' anchors are known
    assert [t.agent for t in measured] == list(AGENTS) * 4
    per_session = [measured[i : i + 3] for i in range(0, len(measured), 3)]
    assert all(len({t.session for t in calls}) == 1 for calls in per_session)
    assert len({calls[0].session for calls in per_session}) == 4
    learner = runtime.learner
    supervisor, coder = learner.agents.index("supervisor"), learner.agents.index("coder")
    assert learner.counts()[supervisor, coder] > 0  # the session's last agent is the parent


def test_untagged_requests_are_learned_as_agents_with_sessions():
    runtime, kv = AgentKVRuntime(), manager(400)
    runtime.install(kv)
    sessions(runtime, kv, 4)
    measured = sessions(runtime, kv, 4, first=4)
    tags = [(agent, runtime.tag_of(req)) for agent, req in measured]
    names = {agent: {t.agent for a, t in tags if a == agent} for agent in AGENTS}
    assert all(len(v) == 1 and next(iter(v)).startswith("fp:") for v in names.values())
    assert len({next(iter(v)) for v in names.values()}) == 3
    per_session = [tags[i : i + 3] for i in range(0, len(tags), 3)]
    for calls in per_session:
        assert len({t.session for _, t in calls}) == 1  # no X-Session-ID: followed by continuation
        assert [t.parent for _, t in calls] == ["", *(t.agent for _, t in calls[:-1])]
    stats = runtime.stats()
    fp = next(iter(names["coder"]))
    assert stats["agents"][fp]["queries"] > 0 and stats["agents"][fp]["hits"] > 0
    assert fp in runtime.learner.agents and runtime.tagged_requests == stats["recognition"]["recognized_requests"]
    assert stats["recognition"]["unrecognized_requests"] + stats["recognition"]["recognized_requests"] == 24
    assert runtime.handle({"op": "recognized"})["recognized"][-1][1] == next(iter(names["reviewer"]))


def test_tags_win_and_name_the_recognized_anchor():
    runtime, kv = AgentKVRuntime(), manager(400)
    runtime.install(kv)
    for s in range(4):  # a tagged client: its agent names label the anchors
        history = tokens(f"task-{s}", 50)
        for agent in AGENTS:
            params = SamplingParams(max_tokens=1, extra_args=AgentTag(agent, f"t{s}").to_xargs())
            req = Request(f"t{next(_ids)}", ANCHORS[agent] + history, params, None, block_hasher=HASHER)
            run(kv, runtime, req)
            assert runtime.tag_of(req).agent == agent
    other = untagged(ANCHORS["coder"] + tokens("task-x", 50), session_id="chat-1")
    run(kv, runtime, other)
    assert runtime.tag_of(other) == AgentTag("coder", "chat-1", "", 0)  # one model for both kinds of client


def test_recognition_off():
    config = RuntimeConfig.from_env({"AGENTKV_RECOGNIZE": "0"})
    assert not config.recognize and RuntimeConfig.from_env({}).recognize
    runtime, kv = AgentKVRuntime(config), manager(400)
    runtime.install(kv)
    measured = sessions(runtime, kv, 4)
    assert all(runtime.tag_of(req) is None for _, req in measured)
    assert runtime.stats()["recognition"] is None and runtime.policy == "lru"


def test_an_x_session_id_off_the_wire_is_counted_and_recognition_follows_the_session():
    runtime, kv = AgentKVRuntime(), manager(400)
    runtime.install(kv)
    sessions(runtime, kv, 4)
    history = tokens("task-odd", 50)
    calls = []
    for agent in AGENTS:  # a client whose session ids have spaces: not an agentkv id
        req = untagged(ANCHORS[agent] + history, session_id="user 42")
        run(kv, runtime, req)
        calls.append(runtime.tag_of(req))
        history = history + tokens(f"out-odd-{agent}", 40)
    assert all(tag is not None and tag.agent.startswith("fp:") for tag in calls)
    assert len({tag.session for tag in calls}) == 1 and calls[0].session.startswith("fs:")
    assert [tag.parent for tag in calls] == ["", calls[0].agent, calls[1].agent]
    assert runtime.malformed.total == 3  # each request's X-Session-ID counted, none served untagged


def test_an_agent_only_request_with_an_x_session_id_off_the_wire_gets_the_session_recognition_finds():
    """Tagged with its agent alone and an X-Session-ID that is no agentkv id: the header is counted
    and ignored, and the request is read as one that sends no session (recognition follows the
    conversation), not as a call outside any session."""
    runtime, kv = AgentKVRuntime(), manager(400)
    runtime.install(kv)
    sessions(runtime, kv, 4)
    history = tokens("task-odd-tagged", 50)
    calls = []
    for agent in AGENTS:
        params = SamplingParams(max_tokens=1, extra_args=AgentTag(agent).to_xargs())
        req = Request(f"a{next(_ids)}", ANCHORS[agent] + history, params, None, block_hasher=HASHER,
                      session_id="user 42")
        run(kv, runtime, req)
        calls.append(runtime.tag_of(req))
        history = history + tokens(f"out-odd-tagged-{agent}", 40)
    assert [tag.agent for tag in calls] == list(AGENTS)
    assert len({tag.session for tag in calls}) == 1 and calls[0].session.startswith("fs:")
    assert runtime.malformed.total == 3


def test_an_untagged_answer_is_told_to_its_recognized_session():
    """The middleware names an untagged request by its response id (vLLM runs it as that id plus
    ``-`` and 8 random characters); the answer reaches the session recognition gave it."""
    runtime, kv = AgentKVRuntime(), manager(400)
    runtime.install(kv)
    sessions(runtime, kv, 4)
    history = tokens("task-told", 50)
    req = Request("chatcmpl-4f2a-1b2c3d4e", ANCHORS["supervisor"] + history, SamplingParams(max_tokens=1), None,
                  block_hasher=HASHER)
    run(kv, runtime, req)
    session = runtime.tag_of(req).session
    assert session is not None and runtime.timing.told(session) is None
    assert runtime.handle({"op": "answered", "request": "chatcmpl-4f2a", "tool_call": True}) == {"answered": True}
    assert runtime.timing.told(session) is True and runtime.answers["tool_call"] == 1
    # told once; an id nobody recognized, or a malformed one, changes nothing
    assert runtime.handle({"op": "answered", "request": "chatcmpl-4f2a", "tool_call": False}) == {"answered": False}
    assert runtime.handle({"op": "answered", "request": "chatcmpl-none", "tool_call": False}) == {"answered": False}
    assert runtime.handle({"op": "answered", "request": "x" * 300, "tool_call": True})["status"] == 400
    assert runtime.handle({"op": "answered", "request": 7, "tool_call": True})["status"] == 400
    assert runtime.timing.told(session) is True and runtime.answers == {"tool_call": 1}


def _run_answering(kv, runtime: AgentKVRuntime, req: Request, answer: list[int]) -> None:
    """``run``, with the answer the model generated (read by the runtime when the request is freed)."""
    runtime.on_add_request(req)
    runtime.refresh()
    computed, hit, _ = kv.get_computed_blocks(req)
    kv.record_prefix_cache_stats(req, hit)
    assert kv.allocate_slots(req, req.num_tokens - hit, hit, computed) is not None
    req.num_computed_tokens = req.num_tokens
    req.append_output_token_ids(answer)
    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)


def test_a_preempted_request_is_read_when_it_finishes():
    """The scheduler frees a preempted request's blocks while it still runs: its partial answer
    is not indexed, and its whole answer is once it finishes."""
    runtime, kv = AgentKVRuntime(), manager(400)
    runtime.install(kv)
    sessions(runtime, kv, 4)
    supervisor = untagged(ANCHORS["supervisor"] + tokens("task-preempted", 50))
    answer = tokens("the supervisor's long answer", 80)
    runtime.on_add_request(supervisor)
    computed, hit, _ = kv.get_computed_blocks(supervisor)
    kv.record_prefix_cache_stats(supervisor, hit)
    assert kv.allocate_slots(supervisor, supervisor.num_tokens - hit, hit, computed) is not None
    supervisor.status = RequestStatus.RUNNING
    supervisor.append_output_token_ids(answer[:8])
    kv.free(supervisor)  # preempted after 8 tokens
    coder = untagged(ANCHORS["coder"] + tokens("notes", 30) + answer)
    run(kv, runtime, coder)
    assert runtime.tag_of(coder).session != runtime.tag_of(supervisor).session  # nothing indexed yet
    computed, hit, _ = kv.get_computed_blocks(supervisor)  # resumed (not added again), then finished
    assert kv.allocate_slots(supervisor, supervisor.num_tokens - hit, hit, computed) is not None
    supervisor.append_output_token_ids(answer[8:])
    supervisor.status = RequestStatus.FINISHED_STOPPED
    kv.free(supervisor)
    again = untagged(ANCHORS["coder"] + tokens("other notes", 30) + answer)
    run(kv, runtime, again)
    assert runtime.tag_of(again).session == runtime.tag_of(supervisor).session
    assert runtime.recognizer.quoting == 1 and runtime.tag_of(again).parent == runtime.tag_of(supervisor).agent


def test_a_request_handed_an_answer_joins_the_answers_session():
    """A hand-off without a shared history: the next agent is given the previous one's answer
    after its own anchor and notes. Recognition finds the session, and the parent, by the answer."""
    runtime, kv = AgentKVRuntime(), manager(400)
    runtime.install(kv)
    sessions(runtime, kv, 4)  # the anchors are learned
    supervisor = untagged(ANCHORS["supervisor"] + tokens("task-handoff", 50))
    answer = tokens("the supervisor's answer", 80)
    _run_answering(kv, runtime, supervisor, answer)
    coder = untagged(ANCHORS["coder"] + tokens("the coder's own notes", 30) + answer)
    run(kv, runtime, coder)
    stranger = untagged(ANCHORS["coder"] + tokens("another task", 30) + answer[:6])  # too little of it
    run(kv, runtime, stranger)
    handed, given, other = runtime.tag_of(supervisor), runtime.tag_of(coder), runtime.tag_of(stranger)
    assert given.session == handed.session and given.parent == handed.agent != given.agent
    assert other.session not in (handed.session, None) and other.parent == ""
    assert runtime.stats()["recognition"]["quoting_requests"] == 1


def test_an_answer_to_a_request_naming_its_agent_alone_and_vllms_session_id_is_told_by_its_response_id():
    """The agent in ``vllm_xargs``, the session in vLLM's own ``session_id`` (X-Session-ID): the
    middleware sees no session in agentkv's metadata and tells the answer by response id, which the
    engine did not record (it did so only for recognized sessions): the answer was lost."""
    runtime, kv = AgentKVRuntime(), manager(400)
    runtime.install(kv)
    params = SamplingParams(max_tokens=1, extra_args=AgentTag("coder").to_xargs())
    req = Request("chatcmpl-7-abcdefgh", ANCHORS["coder"] + tokens("task-v", 50), params, None,
                  block_hasher=HASHER, session_id="chat-9")
    run(kv, runtime, req)
    assert runtime.tag_of(req) == AgentTag("coder", "chat-9")
    assert runtime.handle({"op": "answered", "request": "chatcmpl-7", "tool_call": True}) == {"answered": True}
    assert runtime.timing.told("chat-9") is True
