"""contract.otlp_json: ids, typed values and documents, read the way senders and backends
write them and written the way the OTLP/JSON specification says."""

from __future__ import annotations

import base64
import json

import pytest

from kvscope.contract import otlp_json, semconv

TRACE = "5b8efff798038103d269b633813fc60c"
SPAN = "eee19b7ec3c1b174"


def _document(**span: object) -> dict:
    return {"resourceSpans": [{"resource": {"attributes": [
        {"key": semconv.PROCESS_PID, "value": {"intValue": "42"}}]},
        "scopeSpans": [{"scope": {"name": "t"}, "spans": [
            {"traceId": TRACE, "spanId": SPAN, "name": "s", "startTimeUnixNano": "1",
             "endTimeUnixNano": "2", **span}]}]}]}


def test_ids_read_from_hex_of_either_case_or_base64_and_written_lowercase_hex():
    raw = bytes.fromhex(TRACE)
    assert otlp_json.id_bytes(TRACE.upper(), 16, "f") == raw
    assert otlp_json.id_bytes(base64.b64encode(raw).decode(), 16, "f") == raw
    assert otlp_json.hex_id(raw) == TRACE
    assert otlp_json.id_bytes("", 8, "f") == b""


@pytest.mark.parametrize("text", ["ab", SPAN + "00", "zz" * 8, 12, "00112233 4455667"])
def test_ids_of_the_wrong_length_or_kind_are_refused_with_the_field(text):
    with pytest.raises(otlp_json.OtlpJsonError, match=r"^links\[0\]\.spanId: .* not an id"):
        otlp_json.id_bytes(text, 8, "links[0].spanId")


@pytest.mark.parametrize(("key", "stored", "restored"), [
    (semconv.READER_TIDS, "[18253,18254]", [18253, 18254]),  # Jaeger: an array as JSON text
    (semconv.READER_TIDS, [], []),
    (semconv.LEDGER_TIER, '["disk","none"]', ["disk", "none"]),
    (semconv.LEDGER_FACT_NS, ["-1", 5.0], [-1, 5]),
    (semconv.READ_BYTES, "9223372036854775222", 9223372036854775222),  # Jaeger UI: > 2^53
    (semconv.GEN_AI_TTFT, 1, 1.0),
    (semconv.READ_AHEAD, "true", True),
    ("not.ours", "[1]", "[1]"),
])
def test_kvscope_attributes_are_restored_to_their_declared_type(key, stored, restored):
    value = otlp_json.decode_attribute(key, stored)
    assert value == restored and type(value) is type(restored)


@pytest.mark.parametrize(("key", "stored"), [
    (semconv.READER_TIDS, "[18253"), (semconv.READER_TIDS, "18253"),
    (semconv.LEDGER_TIER, "[1]"), (semconv.READ_BYTES, "1_000"), (semconv.READ_BYTES, True),
    (semconv.READ_BYTES, 1.5), (semconv.REQUEST_ID, 7), (semconv.READ_AHEAD, 1),
])
def test_values_that_cannot_be_the_declared_type_are_refused_naming_the_key(key, stored):
    with pytest.raises(otlp_json.OtlpJsonError, match=f"^attribute {key}: "):
        otlp_json.decode_attribute(key, stored)


def test_every_kvscope_key_has_a_declared_type():
    keys = {v for k, v in vars(semconv).items() if k.isupper() and isinstance(v, str)
            and v.startswith(("kvscope.", "gen_ai.")) and not k.startswith(("SPAN_", "EVENT_"))}
    assert keys - set(semconv.ATTRIBUTE_TYPES) == set()


def test_a_document_round_trips_with_hex_ids_on_spans_and_links_and_integer_enums():
    document = _document(parentSpanId=SPAN.upper(), kind="SPAN_KIND_SERVER",
                         links=[{"traceId": TRACE, "spanId": SPAN}],
                         status={"code": "STATUS_CODE_ERROR"})
    written = otlp_json.encode(otlp_json.decode(document))
    span = written["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert (span["traceId"], span["spanId"], span["parentSpanId"]) == (TRACE, SPAN, SPAN)
    assert span["links"] == [{"traceId": TRACE, "spanId": SPAN}]
    assert (span["kind"], span["status"]) == (2, {"code": 2})
    assert otlp_json.decode(json.loads(otlp_json.dumps(otlp_json.decode(written)))) == \
        otlp_json.decode(document)


def test_stringified_arrays_come_back_typed_in_the_message():
    document = _document(attributes=[
        {"key": semconv.READER_TIDS, "value": {"stringValue": "[7,8]"}},
        {"key": semconv.LEDGER_KEY, "value": {"stringValue": '["a1","b2"]'}}])
    span = next(otlp_json.spans(otlp_json.decode(document)))
    assert otlp_json.attributes(span.attributes) == {semconv.READER_TIDS: [7, 8],
                                                     semconv.LEDGER_KEY: ["a1", "b2"]}
    assert span.attributes[0].value.array_value.values[0].int_value == 7


@pytest.mark.parametrize(("document", "says"), [
    pytest.param([], "the document: a JSON array where an object belongs", id="array"),
    pytest.param({"resourceSpans": {}}, "resourceSpans: a JSON object where an array belongs",
                 id="resourceSpans-dict"),
    pytest.param({"resourceSpans": [{"scopeSpans": [{"spans": [3]}]}]},
                 "resourceSpans[0].scopeSpans[0].spans[0]: a JSON number where an object",
                 id="int-span"),
    pytest.param(_document(spanId=12), "spans[0].spanId: 12 is not an id", id="int-id"),
    pytest.param(_document(traceId=TRACE[:24]), "spans[0].traceId: '5b8e", id="short-id"),
    pytest.param(_document(traceId="0" * 32), "spans[0].traceId: all zeros", id="zero-id"),
    pytest.param(_document(spanId=None), "spans[0].spanId: missing", id="no-id"),
    pytest.param(_document(links=[{"traceId": TRACE, "spanId": SPAN + "0011"}]),
                 "spans[0].links[0].spanId: ", id="long-link-id"),
    pytest.param(_document(startTimeUnixNano="soon"), "spans[0].startTimeUnixNano: ",
                 id="bad-time"),
    pytest.param(_document(attributes=[{"key": semconv.READER_TIDS,
                                        "value": {"stringValue": "[18253"}}]),
                 "spans[0] ('s'): attribute kvscope.storage.reader_tids: '[18253' is not an "
                 "array of integers", id="broken-array"),
    pytest.param({"resource_spans": []}, "OTLP/JSON keys are lowerCamelCase", id="snake-case"),
])
def test_malformed_documents_name_the_field(document, says):
    with pytest.raises(otlp_json.OtlpJsonError) as caught:
        otlp_json.decode(document)
    assert says in str(caught.value)


def test_deeply_nested_text_is_an_error_not_a_crash():
    with pytest.raises(otlp_json.OtlpJsonError, match="nested too deeply"):
        otlp_json.loads("[" * 200_000)
