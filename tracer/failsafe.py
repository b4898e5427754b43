# SPDX-License-Identifier: Apache-2.0
"""Fail closed: no kvscope error ever reaches vLLM.

Every wrapper is installed through `guard(hook, wrapper)`. The guarded wrapper calls vLLM's
function exactly once and returns what vLLM returned (or raises what vLLM raised), whatever
kvscope's own code did around it: a kvscope error before the call runs the call itself, one
after it returns the call's result, and one raised while vLLM's own exception was being handled
gives way to vLLM's exception. Each kvscope error is counted here (`counts()`, per hook and per
config variable; the pipeline writes them into its stats and `manifest.tracer`) and logged once
per process per hook, in one line saying what to fix.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import traceback
from typing import Any, Awaitable, Callable

logger = logging.getLogger(__name__)

CONFIG = "config."  # prefix of the `where` of configuration errors (config.<VARIABLE>)
HOOK_FIX = ("served as if kvscope were not installed; a kvscope bug, or a vLLM/LMCache version "
            "whose internals kvscope does not know: report it with this line "
            "(KVSCOPE_TRACING=0 turns kvscope's tracing off)")
# Test-only fault injection: a comma-separated list of hooks (`Owner.method`) and places
# (`pipeline.build`) that raise InjectedFault, to show that serving goes on. Read at import.
ENV_FAULTS = "KVSCOPE_FAULT_INJECTION"
_FAULTS = frozenset(w.strip() for w in os.environ.get(ENV_FAULTS, "").split(",") if w.strip())

Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]

_lock = threading.Lock()
_counts: dict[str, int] = {}
_logged: set[str] = set()
_version = [0]  # bumped by every count: the recorder sends the counts on when it moves


class InjectedFault(RuntimeError):
    """Raised where KVSCOPE_FAULT_INJECTION says (tests only)."""


def inject(where: str) -> None:
    """Raise InjectedFault if KVSCOPE_FAULT_INJECTION names `where`."""
    if where in _FAULTS:
        raise InjectedFault(f"fault injected at {where} by {ENV_FAULTS} (test only)")


def count(where: str, error: BaseException, fix: str = HOOK_FIX) -> None:
    """Count one kvscope error at `where`; the first one there in this process is logged."""
    with _lock:
        _counts[where] = _counts.get(where, 0) + 1
        _version[0] += 1
        first = where not in _logged
        _logged.add(where)
    if not first:
        return
    if where.startswith(CONFIG):
        logger.warning("kvscope tracer (pid %d): bad setting: %s; %s", os.getpid(), error, fix)
    else:
        logger.warning("kvscope tracer (pid %d): %s: %s%s; %s (further errors here are only "
                       "counted)", os.getpid(), where, _describe(error), _origin(error), fix)
        logger.debug("kvscope tracer: %s", where, exc_info=error)


def counts() -> dict[str, int]:
    """This process's kvscope errors by hook (`Owner.method`) or `config.<VARIABLE>`."""
    with _lock:
        return dict(_counts)


def version() -> int:
    """Changes whenever a count does (read without the lock: a stale value only delays)."""
    return _version[0]


def reset() -> None:
    """Forget every count and every logged hook (tests; a forked child starts here too)."""
    with _lock:
        _counts.clear()
        _logged.clear()
        _version[0] += 1


os.register_at_fork(after_in_child=reset)  # a child counts (and logs) its own errors


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _origin(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" (at {last.filename}:{last.lineno} in {last.name})"


class _Call:
    """One call of vLLM's function, as the wrapper makes it: ran? returned what? raised what?"""

    def __init__(self, hook: str, wrapped: Callable[..., Any]) -> None:
        self.hook, self.wrapped = hook, wrapped
        self.called = False
        self.result: Any = None
        self.raised: BaseException | None = None

    def _enter(self) -> None:
        if self.called:
            raise RuntimeError(f"kvscope wrapper of {self.hook} called it twice")
        self.called = True

    def call(self, *args: Any, **kwargs: Any) -> Any:
        self._enter()
        try:
            self.result = self.wrapped(*args, **kwargs)
        except BaseException as e:
            self.raised = e
            raise
        return self.result

    async def call_async(self, *args: Any, **kwargs: Any) -> Any:
        self._enter()
        try:
            self.result = await self.wrapped(*args, **kwargs)
        except BaseException as e:
            self.raised = e
            raise
        return self.result

    def outcome(self, error: BaseException) -> tuple[bool, Any]:
        """After the wrapper raised `error`: (True, result) to return, (False, None) when
        vLLM's function has not run yet; re-raises vLLM's own exception, or a signal."""
        if self.raised is not None:
            if error is not self.raised and isinstance(error, Exception):
                count(self.hook, error)
            raise self.raised
        if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: not kvscope's
            raise error
        count(self.hook, error)
        return (True, self.result) if self.called else (False, None)


def guard(hook: str, wrapper: Wrapper) -> Wrapper:
    """`wrapper` (wrapt-style, sync or async) made unable to fail vLLM's call; see the module."""
    if inspect.iscoroutinefunction(wrapper):
        @functools.wraps(wrapper)
        async def guarded_async(wrapped: Callable[..., Awaitable[Any]], instance: Any,
                                args: tuple, kwargs: dict) -> Any:
            call = _Call(hook, wrapped)
            pending: list[Any] = []

            def start(*a: Any, **kw: Any) -> Any:
                pending.append(call.call_async(*a, **kw))
                return pending[-1]

            failure: BaseException | None = None
            try:
                if _FAULTS:
                    inject(hook)
                return await wrapper(start, instance, args, kwargs)
            except BaseException as e:
                failure = e
            for coroutine in pending:  # made but never awaited: close, so none warns
                if inspect.getcoroutinestate(coroutine) == inspect.CORO_CREATED:
                    coroutine.close()
            done, result = call.outcome(failure)
            return result if done else await wrapped(*args, **kwargs)

        return guarded_async

    @functools.wraps(wrapper)
    def guarded(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        call = _Call(hook, wrapped)
        failure: BaseException | None = None
        try:
            if _FAULTS:
                inject(hook)
            return wrapper(call.call, instance, args, kwargs)
        except BaseException as e:
            failure = e
        done, result = call.outcome(failure)  # outside `except`: vLLM's error keeps its context
        return result if done else wrapped(*args, **kwargs)

    return guarded
