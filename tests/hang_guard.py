"""A hang guard for one block of a test: pytest-timeout's signal method, scoped to the block that may hang (the suite's
own timeout, pyproject's `timeout`, is the thread method and ends the whole worker)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@contextlib.contextmanager
def hang_guard(seconds: int, what: Callable[[], str]) -> Iterator[None]:
    """Fail the test if the block still runs after `seconds`: pytest.fail, raised in the main thread (the block's
    `finally` clauses clean up after it), with the message `what()` returns then (say what is stuck). Main thread only
    (SIGALRM)."""
    def fail(_signum: int, _frame: Any) -> None:
        pytest.fail(f"still waiting after {seconds} s: {what()}")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
