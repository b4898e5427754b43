"""OTLP JSON span documents -> one DataFrame of spans on the run's monotonic clock.

The documents, their ids and their attribute values are read by contract.otlp_json (the one
reader of the format), so kvscope's attributes arrive as their declared types.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from kvscope.contract import otlp_json, rundir, semconv
from kvscope.contract.semconv import NO_PID, SPAN_COLUMNS


def empty_spans() -> pd.DataFrame:
    """The spans frame with its columns and dtypes and no rows."""
    return _frame([])


def read_span_files(files: list[Path], offset_ns: int) -> tuple[pd.DataFrame, list[str]]:
    """All spans of `files` (epoch ns minus `offset_ns` = monotonic ns) and the files' problems."""
    rows: list[tuple[Any, ...]] = []
    problems: list[str] = []
    for path in files:
        found, bad = read_rows(path, offset_ns)
        rows += found
        problems += bad
    return _frame(rows), problems


def read_rows(path: Path, offset_ns: int) -> tuple[list[tuple], list[str]]:
    """One file's span rows (SPAN_COLUMNS' values, attributes as a dict) and its problem."""
    return document_rows(path, rundir.read_file(path, rundir.SPAN_FILE_MAX_BYTES), offset_ns)


def document_rows(path: Path, document: bytes, offset_ns: int
                  ) -> tuple[list[tuple], list[str]]:
    """The rows and problem of `document`, the contents of span file `path`. A document that
    is not OTLP JSON is skipped (a problem line); one whose span times do not fit the table
    (int64 ns on the run's clock) is refused: RunDirError naming the file and the field."""
    try:
        return _rows(otlp_json.loads(document), offset_ns), []
    except otlp_json.TimeRangeError as e:
        raise rundir.RunDirError(f"{path}: {e}; fix or remove the file") from None
    except otlp_json.OtlpJsonError as e:
        return [], [f"{path}: not an OTLP JSON ExportTraceServiceRequest ({e}); skipped"]
    except _OutOfRange as e:
        raise rundir.RunDirError(f"{path}: {e}; fix or remove the file") from None


class _OutOfRange(ValueError):
    """A span time that is no int64 ns on the run's clock."""


INT64 = (-(1 << 63), (1 << 63) - 1)


def _times(span: Any, offset_ns: int) -> tuple[int, int]:
    """The span's start and end (OTLP epoch ns) on the run's monotonic clock."""
    times = []
    for field, epoch_ns in (("startTimeUnixNano", span.start_time_unix_nano),
                            ("endTimeUnixNano", span.end_time_unix_nano)):
        if not INT64[0] <= epoch_ns - offset_ns <= INT64[1]:
            raise _OutOfRange(f"span {span.name!r}: {field} {epoch_ns} is past int64 "
                              "nanoseconds on the run's clock")
        times.append(epoch_ns - offset_ns)
    return times[0], times[1]


def _rows(message: otlp_json.Request, offset_ns: int) -> list[tuple]:
    rows = []
    for resource_spans in message.resource_spans:
        resource = otlp_json.attributes(resource_spans.resource.attributes)
        process = (str(resource.get(semconv.SERVICE_NAME, "")),
                   pid_of(resource.get(semconv.PROCESS_PID)))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                attributes = otlp_json.attributes(span.attributes)
                request_id = attributes.get(semconv.REQUEST_ID)
                rows.append((
                    otlp_json.hex_id(span.trace_id), otlp_json.hex_id(span.span_id),
                    otlp_json.hex_id(span.parent_span_id), span.name,
                    *_times(span, offset_ns),
                    None if request_id is None else str(request_id), attributes, *process,
                ))
    return rows


def _frame(rows: list[tuple]) -> pd.DataFrame:
    frame = pd.DataFrame.from_records(rows, columns=list(SPAN_COLUMNS))
    return frame.astype({"start_ns": "int64", "end_ns": "int64", "service": "str",
                         "pid": "int64"})


def pid_of(value: int | None) -> int:
    """The resource's process.pid (the emitting process), NO_PID when absent."""
    return NO_PID if value is None else value
