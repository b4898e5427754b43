"""`kvscope import` of hostile documents, generated: OTLP/JSON (`resourceSpans`, and Jaeger's
`/api/v3` wrapping of it) and Jaeger's JSON (`{"data"}`, a top-level array, one trace), each
field either of its right form or replaced by a value of the wrong type, a number far out of
range (past int64 and fixed64, negative, inf, NaN, over Python's 4300-digit conversion limit),
an odd id or JSON nested deep. Whatever comes, the import succeeds or says why in one line and
exit code 2: never another exception, never a traceback.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.cli import main
from kvscope.contract import semconv

# Placeholders for what json.dumps cannot write: an integer over Python's digits limit and
# nesting deeper than its encoder's recursion allows; put into the text after dumps.
_OVERLONG = "\x00overlong"
_DEEP = "\x00deep:"
_PLACEHOLDER = re.compile(r'"\\u0000(overlong|deep:(\d+))"')
SETTINGS = settings(derandomize=True, deadline=None, max_examples=80, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

EDGE_INTEGERS = [0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63,
                 -2**63 - 1, 10**30, 1_764_000_000_000_000_000, 1_764_000_000_000_000]
numbers = st.one_of(
    st.sampled_from(EDGE_INTEGERS), st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e300, -1e300, 0.5, 2.0**63, 2.0**64, 1e15 + 0.5]),
    st.just(_OVERLONG), st.sampled_from(EDGE_INTEGERS).map(str))
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=12),
                    st.integers(2, 1200).map(lambda depth: f"{_DEEP}{depth}"))
anything = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)


def mostly(right: st.SearchStrategy[Any], odd: st.SearchStrategy[Any] = anything,
           weight: int = 30) -> st.SearchStrategy[Any]:
    """`right` about `weight` times in `weight` + 1, else `odd`: deep enough documents need
    most fields right, and every field is sometimes wrong. (`odd` goes with a middle number:
    hypothesis draws the ends of a range more often.)"""
    return st.integers(0, weight).flatmap(lambda n: odd if n == weight // 2 else right)


def hex_ids(size: int) -> st.SearchStrategy[Any]:
    """Ids right and odd: hex of the right length (either case), all zeros, of another length,
    protobuf's base64, not hex at all, or not a string."""
    right = st.binary(min_size=size, max_size=size).filter(any)
    return mostly(right.map(bytes.hex), st.one_of(
        right.map(lambda raw: raw.hex().upper()), st.just("0" * 2 * size),
        st.binary(max_size=2 * size).map(bytes.hex), right.map(
            lambda raw: base64.b64encode(raw).decode()), st.text(max_size=2 * size + 2),
        anything), weight=10)


def fields(required: dict[str, st.SearchStrategy[Any]] | None = None,
           **optional: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """An object of `required`'s keys (now and then one missing) and any of `optional`'s, each
    value mostly right; now and then the whole is not an object at all."""
    dropped = object()
    whole = st.fixed_dictionaries(
        {k: mostly(mostly(v), st.just(dropped), weight=60) for k, v in (required or {}).items()},
        optional={k: mostly(v) for k, v in optional.items()})
    return mostly(whole.map(lambda d: {k: v for k, v in d.items() if v is not dropped}),
                  weight=60)


T0_NS = 1_764_000_000_000_000_000
times_ns = st.one_of(st.integers(T0_NS, T0_NS + 10**9).map(str),
                     st.integers(T0_NS, T0_NS + 10**9), st.integers(0, 2**64 + 10).map(str))
times_us = st.one_of(st.integers(T0_NS // 1000, T0_NS // 1000 + 10**6), st.integers(0, 10**6))
names = mostly(st.just(semconv.SPAN_SERVER_REQUEST), st.sampled_from([
    semconv.SPAN_CLIENT_REQUEST, semconv.SPAN_QUEUE, ""]), weight=2)
keys = mostly(st.sampled_from(["x", "service.name", "http.route"]), st.sampled_from([
    semconv.READ_BYTES, semconv.READER_TIDS, semconv.REQUEST_ID, semconv.PHASE,
    semconv.CONCURRENCY, semconv.GEN_AI_TTFT]), weight=2)  # kvscope's keys: retyped or refused
scalar_value = st.one_of(
    fields(stringValue=st.one_of(st.text(max_size=8), st.just("[1,2]"), times_ns)),
    fields(intValue=mostly(times_ns, numbers)), fields(doubleValue=numbers),
    fields(boolValue=st.booleans()), fields(bytesValue=st.text(max_size=8)))
any_value = st.one_of(
    scalar_value, fields(arrayValue=fields(values=st.lists(scalar_value, max_size=3))),
    fields(kvlistValue=fields(values=st.lists(fields({"key": keys, "value": scalar_value}),
                                              max_size=2))))
attributes = st.lists(fields({"key": keys, "value": any_value}), max_size=3)
otlp_span = fields(
    {"traceId": hex_ids(16), "spanId": hex_ids(8), "name": names,
     "startTimeUnixNano": mostly(times_ns, numbers), "endTimeUnixNano": mostly(times_ns, numbers)},
    parentSpanId=hex_ids(8), attributes=attributes,
    kind=mostly(st.integers(0, 5), st.one_of(numbers, st.text(max_size=4)), weight=4),
    events=st.lists(fields(timeUnixNano=mostly(times_ns, numbers), name=st.text(max_size=4),
                           attributes=attributes), max_size=2),
    links=st.lists(fields({"traceId": hex_ids(16), "spanId": hex_ids(8)}), max_size=2),
    status=fields(code=mostly(st.integers(0, 2), numbers), message=st.text(max_size=4)),
    traceState=st.text(max_size=4), droppedAttributesCount=mostly(st.integers(0, 9), numbers))
otlp_document = fields({"resourceSpans": st.lists(fields(
    {"scopeSpans": st.lists(fields({"spans": st.lists(otlp_span, min_size=1, max_size=3)},
                                   scope=fields(name=st.text(max_size=4))),
                            min_size=1, max_size=2)},
    resource=fields(attributes=attributes)), min_size=1, max_size=2)})
otlp_forms = st.one_of(otlp_document, otlp_document.map(lambda d: {"result": d}))

jaeger_tag = st.one_of(*(
    fields({"key": keys, "type": st.just(kind), "value": value}) for kind, value in (
        ("string", st.one_of(st.text(max_size=8), st.just("[1,2]"), times_ns)),
        ("bool", st.booleans()), ("int64", st.one_of(numbers, times_ns)), ("float64", numbers),
        ("binary", st.binary(max_size=6).map(lambda raw: base64.b64encode(raw).decode())),
        ("other", anything))))
jaeger_reference = fields({"traceID": hex_ids(16), "spanID": hex_ids(8)},
                          refType=st.sampled_from(["CHILD_OF", "FOLLOWS_FROM", "x"]))
jaeger_span = fields(
    {"traceID": hex_ids(16), "spanID": hex_ids(8), "operationName": names,
     "startTime": mostly(times_us, numbers), "duration": mostly(times_us, numbers),
     "processID": mostly(st.just("p1"), st.just("p2"))},
    references=st.lists(jaeger_reference, max_size=2), tags=st.lists(jaeger_tag, max_size=3),
    logs=st.lists(fields({"timestamp": mostly(times_us, numbers)},
                         fields=st.lists(jaeger_tag, max_size=2)), max_size=2))
jaeger_trace = fields(
    {"spans": st.lists(jaeger_span, min_size=1, max_size=3),
     "processes": fields({"p1": fields({"serviceName": st.just("kvscope-vllm")},
                                       tags=st.lists(jaeger_tag, max_size=2))})},
    traceID=hex_ids(16))
jaeger_forms = st.one_of(fields({"data": st.lists(jaeger_trace, min_size=1, max_size=2)}),
                         st.lists(jaeger_trace, min_size=1, max_size=2), jaeger_trace)


def _text(document: Any) -> str:
    """`document` as JSON text, placeholders replaced by what they stand for."""
    text = json.dumps(document)  # NaN and Infinity as Python (and kvscope) read them

    def expand(match: re.Match[str]) -> str:
        if match.group(2) is None:
            return "9" * 5000
        depth = int(match.group(2))
        return "[" * depth + "]" * depth

    return _PLACEHOLDER.sub(expand, text)


def _import(text: str) -> int:
    """Import `text` as a file: exit 0, or exit 2 with one line naming the file (any other
    exception fails the test as it is)."""
    with tempfile.TemporaryDirectory(prefix="kvscope-fuzz-") as directory:
        path, run = Path(directory) / "traces.json", Path(directory) / "run"
        path.write_text(text)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(["import", str(path), "--out", str(run)])
        said = err.getvalue()
        assert code in (0, 2), (code, said)
        if code == 2:
            assert said.startswith(f"kvscope import: {path}: ") and said.count("\n") == 1, said
            assert not run.exists(), "nothing written for bad input"
        return code


def _fuzz(documents: st.SearchStrategy[Any]) -> Counter[int]:
    """The exit codes of importing each generated document."""
    codes: Counter[int] = Counter()

    @SETTINGS
    @given(document=documents)
    def try_one(document: Any) -> None:
        codes[_import(_text(document))] += 1

    try_one()
    return codes


def test_any_otlp_document_is_imported_or_refused_in_one_line():
    codes = _fuzz(otlp_forms)
    assert codes[0] and codes[2], f"both ends reached: {codes}"


def test_any_jaeger_document_is_imported_or_refused_in_one_line():
    codes = _fuzz(jaeger_forms)
    assert codes[0] and codes[2], f"both ends reached: {codes}"
