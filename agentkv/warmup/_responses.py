"""What the server answered to tagged requests: the prefix-cache hit (``cached_tokens``) per call.

The warm-up coordinator counts a warm-up as *useful* when the predicted agent's next real call
hit the warmed prefix, i.e. when that call's ``usage.prompt_tokens_details.cached_tokens`` (vLLM
started with ``--enable-prompt-tokens-details``) covers the anchor. That number is only in the
response, so this module observes responses at the same layer as the request tagging in
``agentkv.frameworks._context``: it wraps the openai SDK's ``SyncAPIClient._process_response`` and
``AsyncAPIClient._process_response`` (called once per request, after the last retry, with the
prepared options, i.e. with the agentkv headers, and the HTTP response). The original runs first and
its result is returned unchanged; the wrapper only reads the already-loaded body of non-streaming
responses, and only while a listener is subscribed. Streaming responses are reported with
``cached_tokens=None`` (their usage, if any, arrives in the last chunk, which the caller consumes).

Why not the server's per-agent ``hits`` from ``GET /agentkv/v1/stats``: they also count the
warm-ups themselves and every concurrent session's calls of the same agent, so they cannot say
whether *this* call hit; the response can, exactly, at no extra request.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from agentkv.frameworks._context import ErrorCounter
from agentkv.protocol import AgentTag, parse_headers

__all__ = ["TaggedResponse", "install", "installed", "on_response", "uninstall", "usage_of"]

logger = logging.getLogger("agentkv.warmup")
ERRORS: Final = ErrorCounter(logger)

_PATCH_MARK: Final = "__agentkv_response_wrapped__"
_RAW_RESPONSE_HEADER: Final = "X-Stainless-Raw-Response"  # openai._constants.RAW_RESPONSE_HEADER


@dataclass(frozen=True, slots=True)
class TaggedResponse:
    """The answer to one tagged SDK request.

    ``cached_tokens`` is the server's prefix-cache hit for the prompt (None when unknown: a stream,
    a server without ``--enable-prompt-tokens-details``, a non-JSON body).
    """

    tag: AgentTag
    url: str
    base_url: str
    status: int
    prompt_tokens: int | None
    cached_tokens: int | None
    streamed: bool = False


def usage_of(body: Any) -> tuple[int | None, int | None]:
    """``(prompt_tokens, cached_tokens)`` from an OpenAI-style response body (None when absent)."""
    usage = body.get("usage") if isinstance(body, Mapping) else None
    if not isinstance(usage, Mapping):
        return None, None
    prompt = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return (
        prompt if isinstance(prompt, int) and not isinstance(prompt, bool) else None,
        cached if isinstance(cached, int) and not isinstance(cached, bool) else None,
    )


_listeners: list[Callable[[TaggedResponse], Any]] = []
_lock = threading.Lock()
_originals: dict[type, Callable[..., Any]] = {}


def on_response(fn: Callable[[TaggedResponse], Any]) -> Callable[[], None]:
    """Call ``fn(response)`` for every tagged SDK response (installs the wrapper); returns an unsubscribe.

    Runs on the caller's thread right after the SDK received the response: keep it short.
    Exceptions are swallowed, counted and logged once.
    """
    install()
    with _lock:
        _listeners.append(fn)

    def unsubscribe() -> None:
        with _lock:
            if fn in _listeners:
                _listeners.remove(fn)

    return unsubscribe


def _observe(client: Any, options: Any, response: Any, stream: bool) -> None:
    """Report ``response`` to the listeners if its request was tagged; never raises."""
    if not _listeners:
        return
    try:
        headers = getattr(options, "headers", None)
        if not isinstance(headers, Mapping) or not headers:
            return
        result = parse_headers({str(k): str(v) for k, v in headers.items() if isinstance(v, str)})
        if result.tag is None:
            return
        if not stream:  # with_streaming_response: the caller reads the body later, never touch it
            request = getattr(response, "request", None)
            raw = getattr(request, "headers", {}).get(_RAW_RESPONSE_HEADER) if request is not None else None
            stream = raw == "stream"
        prompt = cached = None
        if not stream:
            try:
                prompt, cached = usage_of(response.json())
            except Exception:  # not JSON, or a body that was not loaded: unknown
                pass
        record = TaggedResponse(
            tag=result.tag,
            url=str(getattr(options, "url", "")),
            base_url=str(getattr(client, "base_url", "")),
            status=int(getattr(response, "status_code", 0) or 0),
            prompt_tokens=prompt,
            cached_tokens=cached,
            streamed=bool(stream),
        )
        with _lock:
            listeners = list(_listeners)
        for fn in listeners:
            try:
                fn(record)
            except Exception as exc:
                ERRORS.record("response listener", exc)
    except Exception as exc:
        ERRORS.record("response observation", exc)


def _wrap_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _process_response(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _observe(self, kwargs.get("options"), kwargs.get("response"), bool(kwargs.get("stream")))
        return result

    setattr(_process_response, _PATCH_MARK, original)
    return _process_response


def _wrap_async(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def _process_response(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = await original(self, *args, **kwargs)
        _observe(self, kwargs.get("options"), kwargs.get("response"), bool(kwargs.get("stream")))
        return result

    setattr(_process_response, _PATCH_MARK, original)
    return _process_response


def install() -> bool:
    """Wrap the SDK's ``_process_response`` once (idempotent, thread-safe); True when wrapped."""
    with _lock:
        if _originals:
            return True
        try:
            from openai import _base_client
        except Exception as exc:
            ERRORS.record("openai import", exc)
            return False
        for name, wrap in (("SyncAPIClient", _wrap_sync), ("AsyncAPIClient", _wrap_async)):
            cls = getattr(_base_client, name, None)
            original = None if cls is None else cls.__dict__.get("_process_response")
            if original is None:
                ERRORS.record("openai response patch", message=f"{name}._process_response not found")
                continue
            if getattr(original, _PATCH_MARK, None) is not None:
                _originals[cls] = getattr(original, _PATCH_MARK)
                continue
            _originals[cls] = original
            cls._process_response = wrap(original)
        return bool(_originals)


def installed() -> bool:
    return bool(_originals)


def uninstall() -> None:
    """Restore the SDK's original ``_process_response`` (mostly for tests)."""
    with _lock:
        for cls, original in _originals.items():
            cls._process_response = original
        _originals.clear()
