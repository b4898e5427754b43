"""failsafe.guard: a kvscope wrapper can never change what vLLM's call returns or raises."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import wrapt

from kvscope.tracer import failsafe

HOOK = "Engine.step"


class Engine:
    """Stands for a vLLM class: counts its calls, returns or raises what it is told."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.calls = 0
        self.fail = fail

    def step(self, x: int, scale: int = 1) -> int:
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        return x * scale

    async def astep(self, x: int, scale: int = 1) -> int:
        await asyncio.sleep(0)
        return self.step(x, scale=scale)


@pytest.fixture(autouse=True)
def _fresh_counts():
    failsafe.reset()
    yield
    failsafe.reset()


def _guarded(wrapper, method: str = "step") -> type:
    cls = type("Engine", (Engine,), {})
    wrapt.wrap_function_wrapper(cls, method, failsafe.guard(HOOK, wrapper))
    return cls


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvscope.tracer.failsafe" and r.levelno == logging.WARNING]


def raise_before(wrapped, instance, args, kwargs):
    raise AttributeError("'Scheduler' object has no attribute 'renamed'")


def raise_after(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    raise KeyError("req-1")


def change_nothing(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def fail_while_handling(wrapped, instance, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    except ValueError:
        raise TypeError("kvscope's error path broke") from None


def call_twice(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    return wrapped(*args, **kwargs) + 1000


@pytest.mark.parametrize("wrapper", [raise_before, raise_after], ids=["before", "after"])
def test_a_kvscope_error_returns_vllms_result_runs_it_once_counts_and_logs_once(
        wrapper, caplog):
    engine = _guarded(wrapper)()
    with caplog.at_level(logging.WARNING, logger="kvscope.tracer.failsafe"):
        results = [engine.step(3, scale=2) for _ in range(3)]
    assert results == [6, 6, 6]
    assert engine.calls == 3, "vLLM's function ran exactly once per call"
    assert failsafe.counts() == {HOOK: 3}
    lines = _warnings(caplog)
    assert len(lines) == 1, lines
    assert HOOK in lines[0] and "test_failsafe.py" in lines[0] and "KVSCOPE_TRACING=0" in lines[0]


def test_vllms_own_exception_passes_unchanged_and_is_not_counted():
    error = ValueError("prompt too long")
    engine = _guarded(change_nothing)(fail=error)
    with pytest.raises(ValueError) as raised:
        engine.step(1)
    assert raised.value is error and raised.value.__context__ is None
    assert engine.calls == 1 and failsafe.counts() == {}


def test_vllms_exception_wins_over_a_kvscope_error_raised_while_handling_it():
    error = ValueError("prompt too long")
    engine = _guarded(fail_while_handling)(fail=error)
    with pytest.raises(ValueError) as raised:
        engine.step(1)
    assert raised.value is error and raised.value.__context__ is None
    assert engine.calls == 1 and failsafe.counts() == {HOOK: 1}


def test_a_wrapper_calling_twice_still_runs_vllms_function_once():
    engine = _guarded(call_twice)()
    assert engine.step(4) == 4
    assert engine.calls == 1 and failsafe.counts() == {HOOK: 1}


def test_signals_are_not_swallowed():
    def interrupted(wrapped, instance, args, kwargs):
        raise KeyboardInterrupt

    engine = _guarded(interrupted)()
    with pytest.raises(KeyboardInterrupt):
        engine.step(1)
    assert failsafe.counts() == {}


async def araise_before(wrapped, instance, args, kwargs):
    coroutine = wrapped(*args, **kwargs)  # made, never awaited: the guard closes it
    del coroutine
    raise RuntimeError("kvscope broke before awaiting")


async def araise_after(wrapped, instance, args, kwargs):
    await wrapped(*args, **kwargs)
    raise RuntimeError("kvscope broke after")


async def afail_while_handling(wrapped, instance, args, kwargs):
    try:
        return await wrapped(*args, **kwargs)
    except ValueError:
        raise TypeError("kvscope's error path broke") from None


@pytest.mark.filterwarnings("error::RuntimeWarning")  # "coroutine ... was never awaited"
@pytest.mark.parametrize("wrapper", [araise_before, araise_after], ids=["before", "after"])
def test_async_wrappers_fail_closed_too(wrapper, caplog):
    engine = _guarded(wrapper, "astep")()
    with caplog.at_level(logging.WARNING, logger="kvscope.tracer.failsafe"):
        assert asyncio.run(engine.astep(5, scale=3)) == 15
        assert asyncio.run(engine.astep(1)) == 1
    assert engine.calls == 2 and failsafe.counts() == {HOOK: 2}
    assert len(_warnings(caplog)) == 1


def test_async_vllm_exception_wins_unchanged():
    error = ValueError("bad request")
    engine = _guarded(afail_while_handling, "astep")(fail=error)
    with pytest.raises(ValueError) as raised:
        asyncio.run(engine.astep(1))
    assert raised.value is error and engine.calls == 1 and failsafe.counts() == {HOOK: 1}


def test_errors_are_logged_once_per_hook_and_counted_per_hook(caplog):
    with caplog.at_level(logging.WARNING, logger="kvscope.tracer.failsafe"):
        for where in ("A.a", "B.b", "A.a", "config.OTEL_BSP_MAX_QUEUE_SIZE"):
            failsafe.count(where, ValueError("x"), fix="set it right")
    assert failsafe.counts() == {"A.a": 2, "B.b": 1, "config.OTEL_BSP_MAX_QUEUE_SIZE": 1}
    lines = _warnings(caplog)
    assert len(lines) == 3 and all("set it right" in line for line in lines)


def test_a_forked_child_counts_its_own_errors():
    failsafe.count("A.a", ValueError("parent's"))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: starts from zero, as vLLM's forked workers must
        failsafe.count("B.b", ValueError("child's"))
        os.write(write, repr(failsafe.counts()).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 1000).decode() == "{'B.b': 1}"
    assert failsafe.counts() == {"A.a": 1}
