"""Trace documents in the formats backends write, read into OTLP messages.

Accepted: an OTLP JSON document (`{"resourceSpans": ...}`, as the OpenTelemetry SDK and
kvscope's own span files write it); OTLP JSON lines (one document a line, the OpenTelemetry
Collector's file exporter); Jaeger's JSON (a trace from the UI's download, a top-level array of
them, or `{"data": [...]}` from `/api/traces`); and the answers of Jaeger's OTLP query API
(`{"result": {"resourceSpans"}}`, possibly several objects in a row). OTLP is read by
contract.otlp_json, Jaeger's form by `jaeger`; both restore kvscope's attribute types. Every
problem is one line naming the file and the field.

A file is read only if it is a regular file (a FIFO or a device is refused, never waited on or
read without end) of at most MAX_DOCUMENT_BYTES, and so is an answer of `--url`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Iterator

from kvscope.capture.trace_import import jaeger
from kvscope.contract import files, otlp_json
from kvscope.contract.spantable import PARTS_DIR
from kvscope.tracer.config import STATS_DIR

# One file or answer: the Collector's file exporter rotates at 100 MB by default, and parsed
# JSON takes about ten times its text in memory.
MAX_DOCUMENT_BYTES = 256 << 20

_TRACER_DIRS = frozenset({STATS_DIR, PARTS_DIR})  # what a tracer keeps beside its span files
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
EXPECTED = ("OTLP JSON, OTLP JSON lines (the Collector's file exporter), Jaeger JSON (UI "
            "download or /api/traces) or a Jaeger /api/v3/traces answer")


class TraceImportError(ValueError):
    """A trace file or answer kvscope cannot import; the message names it and says why, on one
    line: a control character it quotes from the document (a newline in a key, a terminal
    escape) is shown escaped."""

    def __init__(self, message: str) -> None:
        super().__init__(_CONTROL.sub(lambda found: repr(found.group())[1:-1], message))


def read(path: Path) -> list[otlp_json.Request]:
    """Every trace document in `path` (a file, or a directory of them, a tracer's spans
    directory included: its `stats/` counters and `parts/` tables are no traces) as OTLP
    messages."""
    files = sorted(p for p in path.rglob("*") if p.is_file()
                   and not _TRACER_DIRS.intersection(p.relative_to(path).parts[:-1])) \
        if path.is_dir() else [path]
    if not files:
        raise TraceImportError(f"{path}: no files in it; expected {EXPECTED}")
    return [message for file in files for message in read_text(_text(file), str(file))]


def read_text(text: str, source: str) -> list[otlp_json.Request]:
    """The trace documents in `text` (from `source`, named in errors)."""
    messages = []
    for number, document in enumerate(_documents(text, source)):
        where = source if number == 0 else f"{source} (document {number + 1})"
        try:
            messages.append(_message(document, where))
        except (otlp_json.OtlpJsonError, jaeger.JaegerError) as e:
            raise TraceImportError(f"{where}: {e}") from None
    return messages


def _text(file: Path) -> str:
    try:
        data = files.read_bytes(file, MAX_DOCUMENT_BYTES, files.ANY_OWNER)
    except files.UnsafePath as e:
        raise TraceImportError(f"{e} (kvscope import reads regular files, not links, of at "
                               f"most {MAX_DOCUMENT_BYTES >> 20} MiB: split a larger one)") \
            from None
    except OSError as e:
        raise TraceImportError(f"{file}: cannot be read ({e.strerror}); expected {EXPECTED}") \
            from None
    return text_of(data, str(file))


def text_of(data: bytes, source: str) -> str:
    """`data` (from `source`, named in errors) as the UTF-8 text JSON is."""
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise TraceImportError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start}); "
                               f"expected {EXPECTED}") from None


def _documents(text: str, source: str) -> Iterator[Any]:
    """JSON values one after another: one document, JSON lines, or concatenated objects."""
    decoder = json.JSONDecoder(parse_int=_integer)
    position, found = 0, False
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        if position >= len(text):
            break
        try:
            document, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as e:
            line = text.count("\n", 0, e.pos) + 1
            raise TraceImportError(f"{source}: not valid JSON at line {line} ({e.msg}; "
                                   f"truncated?); expected {EXPECTED}") from None
        except RecursionError:
            raise TraceImportError(f"{source}: JSON nested too deeply to be a trace "
                                   "document") from None
        found = True
        yield document
    if not found:
        raise TraceImportError(f"{source}: empty; expected {EXPECTED}")


class _Overlong(float):
    """A JSON integer of more digits than Python converts (sys.get_int_max_str_digits()):
    infinite, as JSON reads a number too large for a float, so that every field wanting an
    integer refuses it by name as it refuses any infinite number, saying what it was."""

    def __repr__(self) -> str:
        return f"a number of over {sys.get_int_max_str_digits()} digits"

    __str__ = __repr__


def _integer(digits: str) -> int | float:
    """A JSON integer: an int, or _Overlong where Python refuses to convert that many digits."""
    try:
        return int(digits)
    except ValueError:
        return _Overlong("-inf" if digits.startswith("-") else "inf")


def _message(document: Any, source: str) -> otlp_json.Request:
    if isinstance(document, dict) and (isinstance(document.get("error"), dict) or (
            document.get("errors") and not document.get("data"))):
        raise TraceImportError(f"{source}: an error answer, not traces: "
                               f"{backend_error(document)}")
    if isinstance(document, dict) and "result" in document:
        document = document["result"]  # Jaeger's /api/v3 wraps the OTLP document
        if not isinstance(document, dict):
            raise TraceImportError(f"{source}: result: a JSON {otlp_json.json_type(document)} "
                                   "where an OTLP document belongs")
    if isinstance(document, dict) and "resourceSpans" in document:
        return otlp_json.decode(document)
    found = jaeger.traces_in(document)
    if found is not None:
        return jaeger.to_otlp(*found)
    keys = sorted(document)[:6] if isinstance(document, dict) else \
        f"a JSON {otlp_json.json_type(document)}"
    raise TraceImportError(f"{source}: JSON, but not a trace document (found {keys}); "
                           f"expected {EXPECTED}")


def backend_error(answer: Any) -> str:
    """The message of a trace backend's JSON error answer (Jaeger's /api/v3
    `{"error": {"httpCode", "message"}}`, its /api/traces `{"errors": [{"msg"}]}`), or the
    answer itself, cut to a line."""
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        return str(answer["error"].get("message", answer["error"]))
    if isinstance(answer, dict) and answer.get("errors"):
        errors = answer["errors"] if isinstance(answer["errors"], list) else [answer["errors"]]
        return "; ".join(str(e.get("msg", e)) if isinstance(e, dict) else str(e)
                         for e in errors)
    return otlp_json.short(answer, 200)
