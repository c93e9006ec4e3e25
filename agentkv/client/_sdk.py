"""The one SDK patch: tag every request with the current tag, report every tagged response.

:func:`install` wraps two hooks of ``SyncAPIClient`` and ``AsyncAPIClient`` in ``openai._base_client``
and, once the application has imported it, in ``anthropic._base_client`` (both SDKs are generated
by Stainless and share these hooks; subclasses such as ``OpenAI``, ``AzureOpenAI`` and
``Anthropic`` reach them through ``super()``):

* ``_prepare_options`` (called once per attempt, for ``create``, streaming and raw responses): the
  original runs first, unchanged, then the current tag's headers are added to the prepared options
  (headers the caller set explicitly, ``X-AgentKV-Agent`` present, win) and the
  :func:`~agentkv.client.on_request` listeners see a :class:`TaggedRequest`;
* ``_process_response`` (once per request, after the last retry): the original runs first and its
  result is returned unchanged; only while :func:`on_response` listeners exist, the already-loaded
  body of a non-streaming response is read for ``usage`` and a :class:`TaggedResponse` reported.

Invariant: nothing here raises into the caller; failures are counted in ``ERRORS`` and logged once.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final

from agentkv.protocol import HEADER_AGENT, parse_headers

from ._errors import COUNTS, ERRORS, count
from ._hooks import REQUEST, RESPONSE, TaggedRequest, TaggedResponse
from ._tags import current_tag, routing_header

__all__ = ["install", "installed", "on_response", "stats", "uninstall", "usage_of"]

_PATCH_MARK: Final = "__agentkv_wrapped__"
_RAW_RESPONSE_HEADER: Final = "X-Stainless-Raw-Response"  # openai._constants.RAW_RESPONSE_HEADER
_install_lock = threading.Lock()
_originals: dict[tuple[type, str], Callable[..., Any]] = {}


def stats() -> dict[str, Any]:
    """Counters of the client side: tagged requests, dispatches, swallowed errors by kind."""
    return {"counts": dict(COUNTS), "errors": dict(ERRORS.by_kind), "installed": installed()}


def on_response(fn: Callable[[TaggedResponse], Any]) -> Callable[[], None]:
    """Call ``fn(response)`` for every tagged SDK response (installs the patch); returns an unsubscribe.

    Runs on the caller's thread right after the SDK received the response: keep it short.
    Exceptions are swallowed, counted and logged once.
    """
    install()
    return RESPONSE.subscribe(fn)


def usage_of(body: Any) -> tuple[int | None, int | None]:
    """``(prompt_tokens, cached_tokens)`` from a response body: a chat completion's or a
    completion's (``prompt_tokens``), a Responses API response's (``input_tokens`` and its
    details) or a Messages API response's (``input_tokens`` counts only the tokens neither read
    from nor written to the cache); None when absent."""
    usage = body.get("usage") if isinstance(body, Mapping) else None
    if not isinstance(usage, Mapping):
        return None, None
    if "prompt_tokens" in usage or "input_tokens_details" in usage:
        kind = "prompt" if "prompt_tokens" in usage else "input"
        details = usage.get(f"{kind}_tokens_details")
        prompt = _count(usage.get(f"{kind}_tokens"))
        return prompt, _count(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    uncached, read = _count(usage.get("input_tokens")), _count(usage.get("cache_read_input_tokens"))
    written = _count(usage.get("cache_creation_input_tokens")) or 0
    return (None if uncached is None else uncached + (read or 0) + written), read


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# -- requests ------------------------------------------------------------------------------


def _tag_options(client: Any, options: Any) -> None:
    """Add the current tag's headers to ``options`` (a FinalRequestOptions); never raises."""
    tag = current_tag()
    if tag is None:
        return
    try:
        headers = options.headers
        existing: Mapping[str, Any] = headers if isinstance(headers, Mapping) else {}
        if any(str(k).lower() == HEADER_AGENT.lower() for k in existing):
            return  # the caller tagged this request explicitly: theirs wins
        merged = dict(existing)
        merged.update(tag.to_headers())
        merged.update(routing_header(tag.agent, tag.session))
        options.headers = merged  # a new mapping: the caller's extra_headers stay untouched
        count("tagged_requests")
        if REQUEST:
            REQUEST.notify(TaggedRequest(
                tag=tag,
                method=str(getattr(options, "method", "")),
                url=str(getattr(options, "url", "")),
                base_url=str(getattr(client, "base_url", "")),
                json_data=getattr(options, "json_data", None),
            ))
    except Exception as exc:
        ERRORS.record("request tagging", exc)


def _wrap_prepare_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _prepare_options(self: Any, options: Any) -> Any:
        options = original(self, options)
        _tag_options(self, options)
        return options

    setattr(_prepare_options, _PATCH_MARK, original)
    return _prepare_options


def _wrap_prepare_async(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def _prepare_options(self: Any, options: Any) -> Any:
        options = await original(self, options)
        _tag_options(self, options)
        return options

    setattr(_prepare_options, _PATCH_MARK, original)
    return _prepare_options


# -- responses -----------------------------------------------------------------------------


def _observe(client: Any, options: Any, response: Any, stream: bool) -> None:
    """Report ``response`` to the listeners if its request was tagged; never raises."""
    if not RESPONSE:
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
        RESPONSE.notify(TaggedResponse(
            tag=result.tag,
            url=str(getattr(options, "url", "")),
            base_url=str(getattr(client, "base_url", "")),
            status=int(getattr(response, "status_code", 0) or 0),
            prompt_tokens=prompt,
            cached_tokens=cached,
            streamed=bool(stream),
        ))
    except Exception as exc:
        ERRORS.record("response observation", exc)


def _wrap_process_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _process_response(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _observe(self, kwargs.get("options"), kwargs.get("response"), bool(kwargs.get("stream")))
        return result

    setattr(_process_response, _PATCH_MARK, original)
    return _process_response


def _wrap_process_async(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def _process_response(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = await original(self, *args, **kwargs)
        _observe(self, kwargs.get("options"), kwargs.get("response"), bool(kwargs.get("stream")))
        return result

    setattr(_process_response, _PATCH_MARK, original)
    return _process_response


# -- installation --------------------------------------------------------------------------

_TARGETS: Final = (
    ("SyncAPIClient", "_prepare_options", _wrap_prepare_sync, "patch"),
    ("AsyncAPIClient", "_prepare_options", _wrap_prepare_async, "patch"),
    ("SyncAPIClient", "_process_response", _wrap_process_sync, "response patch"),
    ("AsyncAPIClient", "_process_response", _wrap_process_async, "response patch"),
)
_SDKS: Final = ("openai", "anthropic")  # openai is required for tagging; anthropic is patched once imported
_untried = list(_SDKS)  # the SDKs not patched (nor found broken) yet


def install() -> bool:
    """Patch the openai SDK, and the anthropic SDK once the application has imported it, each once
    (idempotent, thread-safe: call it again after importing anthropic); True when requests can be
    tagged. Every tag scope, LangGraph run and AutoGen turn calls it, where it costs a dictionary
    read; an SDK nobody imported is never imported here (anthropic's import takes ~1 s)."""
    if not any(sdk in sys.modules or sdk == _SDKS[0] for sdk in _untried):
        return bool(_originals)
    with _install_lock:
        for sdk in [sdk for sdk in _untried if sdk in sys.modules or sdk == _SDKS[0]]:
            _untried.remove(sdk)
            _patch(sdk)
        return bool(_originals)


def _patch(sdk: str) -> None:
    try:
        base_client = importlib.import_module(f"{sdk}._base_client")
    except Exception as exc:  # missing or broken: tagging its requests is simply off
        ERRORS.record(f"{sdk} import", exc)
        return
    for class_name, method, wrap, kind in _TARGETS:
        cls = getattr(base_client, class_name, None)
        original = None if cls is None else cls.__dict__.get(method)
        if cls is None or original is None:
            ERRORS.record(f"{sdk} {kind}", message=f"{sdk} {class_name}.{method} not found")
            continue
        if getattr(original, _PATCH_MARK, None) is not None:  # patched by another copy of this module
            _originals[cls, method] = getattr(original, _PATCH_MARK)
            continue
        _originals[cls, method] = original
        setattr(cls, method, wrap(original))


def installed() -> bool:
    return bool(_originals)


def uninstall() -> None:
    """Restore the SDKs' original hooks (mostly for tests)."""
    with _install_lock:
        for (cls, method), original in _originals.items():
            setattr(cls, method, original)
        _originals.clear()
        _untried[:] = _SDKS
