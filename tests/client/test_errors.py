"""The client's error counter: every swallowed error counted by kind, the first of each kind logged once."""

from __future__ import annotations

import logging
import threading
import time

from agentkv.client import ErrorCounter


class _SlowHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.entered = threading.Event()
        self.emitted: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.entered.set()
        time.sleep(0.3)
        self.emitted.append(record.getMessage())


def test_once_any_record_of_a_kind_returned_its_one_warning_is_out():
    log = logging.getLogger("agentkv.tests.errors")
    handler = _SlowHandler()
    log.addHandler(handler)
    try:
        errors = ErrorCounter(log)
        first = threading.Thread(target=errors.record, args=("events POST to x", RuntimeError("down")))
        first.start()
        assert handler.entered.wait(5)
        errors.record("events POST to x", RuntimeError("down"))  # a second thread's failure of the same kind
        assert len(handler.emitted) == 1 and "events POST to x failed (RuntimeError: down)" in handler.emitted[0]
        first.join(5)
        assert errors.by_kind["events POST to x"] == 2 and len(handler.emitted) == 1
    finally:
        log.removeHandler(handler)


def test_a_handler_that_records_an_error_itself_does_not_deadlock():
    log = logging.getLogger("agentkv.tests.errors.reentrant")
    errors = ErrorCounter(log)

    class Recording(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            errors.record("log handler")

    handler = Recording(logging.WARNING)
    log.addHandler(handler)
    try:
        errors.record("tokenize")
        # the handler's own record logs once more (its first), whose handler records again: counted, not logged
        assert errors.by_kind == {"tokenize": 1, "log handler": 2}
    finally:
        log.removeHandler(handler)
