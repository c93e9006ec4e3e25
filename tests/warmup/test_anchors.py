"""Anchor capture and the prefix-stability lint, against a fake server that renders like a chat template."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
from openai import OpenAI

import agentkv
from agentkv.frameworks import TaggedRequest
from agentkv.protocol import AgentTag
from agentkv.warmup import AnchorBook, common_prefix
from agentkv.warmup._anchors import ANCHOR_REFRESH

from ._fake_vllm import BASE, FakeVLLM, render_tokens, tokenizer_of

SYSTEM = "You are the coder. Write small, correct functions and explain nothing. " * 3
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the docs.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                                          "required": ["q"]}}}
RUN = {"type": "function", "function": {"name": "run", "description": "Run code.",
                                        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}


def chat(system: str = SYSTEM, user: str = "task", tools: list[Any] | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "system", "content": system},
                                                          {"role": "user", "content": user}]}
    if tools is not None:
        body["tools"] = tools
    body.update(extra)
    return body


@pytest.fixture
def fake() -> FakeVLLM:
    return FakeVLLM(block_size=16)


@pytest.fixture
def book(fake: FakeVLLM) -> AnchorBook:
    return AnchorBook(block_size=fake.block_size)


def test_single_call_anchor_is_messages0_plus_tools_floored(fake: FakeVLLM, book: AnchorBook) -> None:
    book.capture("coder", "s1", chat(tools=[SEARCH]))
    anchor = book.resolve("coder", tokenizer_of(fake))
    fixed = render_tokens(fake, [{"role": "system", "content": SYSTEM}], [SEARCH], add_generation_prompt=False)
    assert anchor is not None and anchor.source == "structural"
    assert anchor.length == len(fixed) // 16 * 16 and anchor.length > 0
    assert list(anchor.tokens) == fixed[: anchor.length]
    assert anchor.shared_tokens == len(fixed)
    # the anchor is a prefix of the agent's next real call in another session
    nxt = fake.tokens(chat(user="another task entirely", tools=[SEARCH]))
    assert nxt[: anchor.length] == list(anchor.tokens)


def test_tools_rendered_before_the_system_text(fake: FakeVLLM, book: AnchorBook) -> None:
    fake.tools_first = True
    book.capture("coder", "s1", chat(tools=[SEARCH, RUN]))
    anchor = book.resolve("coder", tokenizer_of(fake))
    rendered = "".join(chr(t) for t in anchor.tokens)
    assert rendered.startswith("<bos><tools>") and "<system>" in rendered
    assert anchor.shared_tokens == len(render_tokens(fake, [{"role": "system", "content": SYSTEM}], [SEARCH, RUN],
                                                     add_generation_prompt=False))


def test_cross_session_anchor_keeps_fixed_few_shot_messages(fake: FakeVLLM, book: AnchorBook) -> None:
    shots = [{"role": "user", "content": "example question " * 6}, {"role": "assistant", "content": "example answer"}]

    def call(task: str) -> dict[str, Any]:
        return {"model": "tiny", "messages": [{"role": "system", "content": SYSTEM}, *shots,
                                              {"role": "user", "content": task}]}

    book.capture("coder", "s1", call("first"))
    book.capture("coder", "s1", {**call("first"), "messages": [*call("first")["messages"],
                                                               {"role": "assistant", "content": "history " * 30}]})
    assert book.resolve("coder", tokenizer_of(fake)).source == "structural"  # one session only
    book.capture("coder", "s2", call("second"))
    anchor = book.resolve("coder", tokenizer_of(fake))
    a, b = fake.tokens(call("first")), fake.tokens(call("second"))
    assert anchor.source == "cross-session"
    assert anchor.shared_tokens == common_prefix(a, b)
    assert anchor.length == common_prefix(a, b) // 16 * 16
    fixed = render_tokens(fake, [{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    assert anchor.length > len(fixed)  # the few-shot examples are part of the anchor


def test_two_sessions_that_open_alike_do_not_stretch_the_anchor(fake: FakeVLLM) -> None:
    """Tasks from a short list: the latest two sessions may share one, and their common prefix is
    then anchor and task. A warm-up of that prefix computes the task for sessions that never send it."""
    clock = [0.0]
    book = AnchorBook(block_size=fake.block_size, clock=lambda: clock[0])
    task = "Add a hit-rate counter to BlockCache and document how to read it. " * 3
    fixed = render_tokens(fake, [{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    book.capture("coder", "s1", chat(user="Write release notes for the new eviction order."))
    book.capture("coder", "s2", chat(user=task))
    assert book.resolve("coder", tokenizer_of(fake)).length == len(fixed) // 16 * 16
    clock[0] += ANCHOR_REFRESH  # a known anchor is recomputed from newer sessions
    book.capture("coder", "s3", chat(user=task))  # opens as s2 did
    anchor = book.resolve("coder", tokenizer_of(fake))
    assert anchor.source == "cross-session" and anchor.length == len(fixed) // 16 * 16  # before: task included
    assert common_prefix(fake.tokens(chat(user=task)), list(anchor.tokens)) == anchor.length


def test_same_session_history_is_not_anchor(fake: FakeVLLM, book: AnchorBook) -> None:
    first = chat(user="task")
    book.capture("coder", "s1", first)
    longer = [*first["messages"], {"role": "assistant", "content": "x" * 200}]
    book.capture("coder", "s1", {**first, "messages": longer})
    anchor = book.resolve("coder", tokenizer_of(fake))
    fixed = render_tokens(fake, [{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    assert anchor.length == len(fixed) // 16 * 16


def test_date_in_system_prompt_is_linted_once_and_shrinks_the_anchor(
    fake: FakeVLLM, book: AnchorBook, caplog: pytest.LogCaptureFixture
) -> None:
    stable = "You are the planner. Plan in numbered steps, one line each, no prose at all. "
    caplog.set_level(logging.WARNING, logger="agentkv.warmup")
    for session, day in (("s1", "2025-01-01"), ("s2", "2025-01-02"), ("s3", "2025-01-03")):
        book.capture("planner", session, chat(system=f"{stable}Today is {day}.", user=f"task {session}"))
    warnings = [r for r in caplog.records if "planner" in r.getMessage()]
    assert len(warnings) == 1, "logged once per agent"
    message = warnings[0].getMessage()
    assert "messages[0]" in message and f"character {len(stable) + len('Today is 2025-01-0')}" in message
    found = book.divergences()["planner"]
    assert found["where"] == "messages[0].content" and found["message"] == 0
    assert found["char"] == len(stable) + len("Today is 2025-01-0") and found["count"] == 2
    assert book.stats()["agents"]["planner"]["stable"] is False
    anchor = book.resolve("planner", tokenizer_of(fake))
    assert anchor.source == "cross-session"
    prefix = len("<bos><system>") + len(stable) + len("Today is 2025-01-0")
    assert anchor.shared_tokens == prefix and anchor.length == prefix // 16 * 16


def test_reordered_tools_are_linted_with_the_tool_named(book: AnchorBook) -> None:
    book.capture("super", "s1", chat(tools=[SEARCH, RUN]))
    book.capture("super", "s2", chat(tools=[RUN, SEARCH]))
    found = book.divergences()["super"]
    assert found["where"] == "tools" and found["tool"] == "search"
    assert "another order" in found["detail"] and "set" in found["detail"]


def test_key_order_inside_parameters_is_linted(book: AnchorBook) -> None:
    swapped = json.loads(json.dumps(SEARCH))
    params = swapped["function"]["parameters"]
    swapped["function"]["parameters"] = {"required": params["required"], "type": params["type"],
                                         "properties": params["properties"]}
    book.capture("coder", "s1", chat(tools=[RUN, SEARCH]))
    book.capture("coder", "s2", chat(tools=[RUN, swapped]))
    found = book.divergences()["coder"]
    assert found["where"] == "tools[1]" and found["tool"] == "search"
    assert "key order" in found["detail"] and "function.parameters" in found["detail"]


def test_changed_tool_names_the_json_path(book: AnchorBook) -> None:
    changed = json.loads(json.dumps(RUN))
    changed["function"]["description"] = "Run code safely."
    book.capture("coder", "s1", chat(tools=[SEARCH, RUN]))
    book.capture("coder", "s2", chat(tools=[SEARCH, changed]))
    found = book.divergences()["coder"]
    assert found["where"] == "tools[1]" and "function.description" in found["detail"]


def test_stable_agent_has_no_finding(fake: FakeVLLM, book: AnchorBook) -> None:
    for s in range(4):
        book.capture("coder", f"s{s}", chat(user=f"task {s}", tools=[SEARCH]))
    assert book.divergences() == {}
    assert book.stats()["agents"]["coder"] | {"anchor_tokens": None} == {
        "calls": 4, "sessions": 4, "anchor_tokens": None, "anchor_blocks": None, "source": None, "stable": True}


def test_date_inserted_by_the_template_is_found_at_token_level(
    fake: FakeVLLM, book: AnchorBook, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="agentkv.warmup")
    tokenize = tokenizer_of(fake)
    fake.date = "26 Jul 2024"
    book.capture("coder", "s1", chat(user="one"))
    book.resolve("coder", tokenize)  # tokenizes the s1 call with yesterday's date
    fake.date = "27 Jul 2024"
    book.capture("coder", "s2", chat(user="two"))
    anchor = book.resolve("coder", tokenize)
    assert book.divergences()["coder"]["where"] == "tokens"
    offset = len("<bos>Today: 2")
    assert book.divergences()["coder"]["token"] == offset
    assert "template" in book.divergences()["coder"]["detail"]
    assert anchor is None  # nothing before the date fills a block: no anchor to warm
    assert any("coder" in r.getMessage() and f"token {offset}" in r.getMessage() for r in caplog.records)


def test_empty_tools_are_never_sent_and_equal_to_no_tools(fake: FakeVLLM, book: AnchorBook) -> None:
    book.capture("coder", "s1", chat(tools=[]))
    book.capture("coder", "s2", chat())
    assert book.divergences() == {}
    sent: list[dict[str, Any]] = []
    tokenize = tokenizer_of(fake)

    def spy(payload: dict[str, Any]) -> list[int]:
        sent.append(payload)
        return tokenize(payload)

    assert book.resolve("coder", spy) is not None
    assert sent and all("tools" not in p for p in sent)
    assert book.resolve("coder", None).chat is not None and "tools" not in book.resolve("coder", None).chat


def test_tools_in_first_user_message_need_two_sessions(fake: FakeVLLM, book: AnchorBook) -> None:
    fake.tools_in_user = True
    tokenize = tokenizer_of(fake)
    book.capture("coder", "s1", chat(user="one", tools=[SEARCH, RUN]))
    assert book.resolve("coder", tokenize) is None  # messages[0] + tools alone cannot be rendered
    book.capture("coder", "s2", chat(user="two", tools=[SEARCH, RUN]))
    anchor = book.resolve("coder", tokenize)
    assert anchor is not None and anchor.source == "cross-session"
    rendered = fake.tokens(chat(user="one", tools=[SEARCH, RUN]))
    tools_end = "".join(chr(t) for t in rendered).index("<end><user>") - len("<user>")  # tools close inside user
    assert anchor.shared_tokens >= tools_end


def test_completion_prompts_and_token_ids(fake: FakeVLLM, book: AnchorBook) -> None:
    fixed = list(range(100, 150))
    book.capture("tok", "s1", {"model": "tiny", "prompt": [*fixed, 1, 2, 3]})
    assert book.resolve("tok", tokenizer_of(fake)) is None  # one session: no structure to tell
    book.capture("tok", "s2", {"model": "tiny", "prompt": [*fixed, 9, 9]})
    anchor = book.resolve("tok", tokenizer_of(fake))
    assert anchor.source == "prompt" and list(anchor.tokens) == fixed[:48]
    book.capture("txt", "s1", {"model": "tiny", "prompt": "You are a helpful bot. " * 3 + "Q1"})
    book.capture("txt", "s2", {"model": "tiny", "prompt": "You are a helpful bot. " * 3 + "Q2"})
    assert book.resolve("txt", tokenizer_of(fake)).length == 64


def test_cache_salt_is_kept_and_a_change_is_linted(fake: FakeVLLM, book: AnchorBook) -> None:
    book.capture("coder", "s1", chat(cache_salt="tenant-a"))
    assert book.resolve("coder", tokenizer_of(fake)).extra == {"cache_salt": "tenant-a"}
    book.capture("coder", "s2", chat(cache_salt="tenant-b"))
    assert book.divergences()["coder"]["where"] == "options.cache_salt"


def test_model_change_starts_over(fake: FakeVLLM, book: AnchorBook) -> None:
    book.capture("coder", "s1", chat())
    book.capture("coder", "s2", {**chat(), "model": "other"})
    assert book.divergences()["coder"]["where"] == "model"
    anchor = book.resolve("coder", tokenizer_of(fake))
    assert anchor.model == "other" and anchor.source == "structural"


def test_observe_filters_and_snapshots(fake: FakeVLLM) -> None:
    book = AnchorBook(base_url=BASE, block_size=16)
    body = chat(tools=[SEARCH])
    book.observe(TaggedRequest(AgentTag("coder", "s1"), "post", "/chat/completions", BASE + "/v1/", body))
    book.observe(TaggedRequest(AgentTag("coder", "s1", warmup=True), "post", "/completions", BASE + "/v1/",
                               {"model": "tiny", "prompt": [1, 2, 3]}))
    book.observe(TaggedRequest(AgentTag("elsewhere", "s1"), "post", "/chat/completions",
                               "http://10.0.0.1:8000/v1/", chat()))
    book.observe(TaggedRequest(AgentTag("coder", "s1"), "post", "/embeddings", BASE + "/v1/", {"input": "x"}))
    body["messages"][0]["content"] = "mutated after the request left"
    body["tools"].append(RUN)
    assert book.agents() == ["coder"]
    assert book.stats()["other_server"] == 1 and book.stats()["ignored"] == 1
    anchor = book.resolve("coder", tokenizer_of(fake))
    fixed = render_tokens(fake, [{"role": "system", "content": SYSTEM}], [SEARCH], add_generation_prompt=False)
    assert list(anchor.tokens) == fixed[: anchor.length]  # the snapshot, not the mutated body


def test_observe_never_raises(book: AnchorBook) -> None:
    book.observe(TaggedRequest(AgentTag("coder", "s1"), "post", "/chat/completions", BASE,
                               {"model": "tiny", "messages": [{"role": "system", "content": object()}]}))
    assert book.stats()["errors"] == {"anchor capture": 1}


def test_capture_through_the_openai_sdk(fake: FakeVLLM) -> None:
    book = AnchorBook(base_url=BASE, block_size=16).attach()
    try:
        client = OpenAI(base_url=BASE + "/v1", api_key="x", http_client=httpx.Client(transport=fake.transport()))
        for session in ("sdk-1", "sdk-2"):
            with agentkv.agent("sdk-coder", session=session):
                client.chat.completions.create(model="tiny", messages=chat(user=session)["messages"], tools=[SEARCH],
                                               tool_choice="none")
        anchor = book.resolve("sdk-coder", tokenizer_of(fake))
        assert anchor is not None and anchor.source == "cross-session" and anchor.model == "tiny"
        assert anchor.chat is not None and anchor.chat["tool_choice"] == "none"
    finally:
        book.detach()


def test_interleaved_sessions_re_tokenize_a_known_anchor_at_most_every_refresh(fake: FakeVLLM) -> None:
    """Sessions calling the same agent in turn renew its latest capture at every call; the anchor
    they share is recomputed (whole calls sent to ``/tokenize``) at most every ``ANCHOR_REFRESH``."""
    now = [0.0]
    book = AnchorBook(block_size=fake.block_size, clock=lambda: now[0])
    tokenize = tokenizer_of(fake)
    asked = []

    def counting(payload: Any) -> Any:
        asked.append(payload)
        return tokenize(payload)

    for turn in range(6):
        for session in ("s1", "s2", "s3"):
            book.capture("coder", session, chat(user=f"{session} turn {turn}"))
            anchor = book.resolve("coder", counting)
            now[0] += 1.0
    assert anchor is not None and anchor.source == "cross-session"
    first = len(asked)
    assert first <= 4  # one structural and one cross-session computation, not one per call
    now[0] += ANCHOR_REFRESH
    book.capture("coder", "s1", chat(user="later"))
    assert book.resolve("coder", counting).tokens == anchor.tokens and len(asked) > first  # recomputed, same


@pytest.mark.parametrize("fields", [{"reasoning_effort": "low"}, {"reasoning_effort": "none"},
                                    {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
                                    {"documents": [{"title": "t", "text": "d"}]}])
def test_an_anchor_renders_as_vllms_chat_endpoint_renders_the_call(fields):
    """vLLM's chat endpoint passes ``reasoning_effort`` (and ``enable_thinking``) and ``documents``
    to the template; ``/tokenize`` has no such fields. Left out, a template that prints the effort
    in its system header (gpt-oss's) rendered an anchor no real call ever hit."""
    import jinja2
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest

    template = jinja2.Template(
        "<|system|>Reasoning: {{ reasoning_effort|default('medium') }} thinking: {{ enable_thinking }} "
        "{{ documents|default([])|length }} docs{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}")

    def render(request) -> list[int]:  # characters as token ids
        kwargs = {k: v for k, v in request.build_chat_params(None, "auto").chat_template_kwargs.items()
                  if v is not None}
        return [ord(c) for c in template.render(messages=[dict(m) for m in request.messages], **kwargs)]

    def call(task: str) -> dict[str, object]:
        return {"model": "m", **fields, "messages": [{"role": "system", "content": "You are the coder. " * 20},
                                                     {"role": "user", "content": task}]}

    book = AnchorBook(block_size=16)
    for number, task in enumerate(["fix bug A", "write test B", "refactor C"]):
        book.capture("coder", f"s{number}", call(task))
    anchor = book.resolve("coder", lambda payload: render(TokenizeChatRequest(**payload)))
    real = render(ChatCompletionRequest(**call("the next task")))
    assert anchor is not None and anchor.length > 0 and list(anchor.tokens) == real[:anchor.length]
