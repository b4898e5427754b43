"""The span table read from the tracer's parts is the table parsed from the span files: the
same rows, the same cleaning; a part that is not current, not readable or not ours is passed
over for its file, never read as rows and never waited on."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from kvscope.analysis import spanstream, spantable
from kvscope.contract import otlp_json, rundir, semconv
from kvscope.contract import spantable as spec
from kvscope.testkit import span_replay
from kvscope.tracer.fileexport import OtlpJsonFileExporter

RECORDED = [Path(__file__).parents[1] / "capture" / "data" / "live-tiny-kvscope",
            Path(__file__).parent / "data" / "live-serial-c16"]
OFFSET = 123_456


def _replayed(run: Path, into: Path) -> Path:
    """A run directory whose span files and parts the file exporter wrote from `run`'s spans."""
    span_replay.export_again(run / rundir.SPANS_DIR, into / rundir.SPANS_DIR)
    return into


def _without_parts(run: Path) -> pa.Table:
    """The run's table parsed from its span files (parts moved aside, then back)."""
    parts = run / rundir.SPANS_DIR / spec.PARTS_DIR
    aside = run / "parts-aside"
    parts.rename(aside)
    try:
        return spantable.build(spantable.span_files(run), OFFSET)
    finally:
        aside.rename(parts)


def _read_from_parts(run: Path) -> int:
    return sum(spanstream.part_rows(f, f.read_bytes(), OFFSET) is not None
               for f in spantable.span_files(run))


@pytest.mark.parametrize("recorded", RECORDED, ids=[r.name for r in RECORDED])
def test_a_recorded_runs_table_is_the_same_from_parts_as_from_its_span_files(recorded,
                                                                              tmp_path):
    run = _replayed(recorded, tmp_path / "run")
    assert _read_from_parts(run) == len(spantable.span_files(run)) > 0
    from_parts = spantable.build(spantable.span_files(run), OFFSET)
    parsed = _without_parts(run)
    assert from_parts.equals(parsed, check_metadata=True)
    # and the replay is the recording: the same table as the recorded files give
    assert parsed.equals(spantable.build(spantable.span_files(recorded), OFFSET),
                         check_metadata=True)
    written = pq.read_table(spantable.ensure(run, OFFSET))
    assert written.select(spec.SCHEMA.names).equals(from_parts)


def test_cleaning_fills_and_drops_the_same_from_parts_as_from_span_files(tmp_path):
    """Spans without a request id get their trace's (a sibling's); a batch exported twice
    repeats its ids."""
    run = tmp_path / "run"
    recorded = spantable.span_files(RECORDED[0])[-1]
    batch = span_replay.sdk_spans(otlp_json.loads(recorded.read_bytes()))
    stripped = set()
    for span in batch[::2]:
        if span.parent is not None:
            span._attributes = {k: v for k, v in span.attributes.items()  # noqa: SLF001
                                if k != semconv.REQUEST_ID}
            stripped.add(f"{span.context.span_id:016x}")
    exporter = OtlpJsonFileExporter(run / rundir.SPANS_DIR, "twice")
    exporter.export(batch)
    exporter.export(batch)
    assert _read_from_parts(run) == 2
    from_parts = spantable.build(spantable.span_files(run), OFFSET)
    assert from_parts.equals(_without_parts(run), check_metadata=True)
    assert from_parts.num_rows < 2 * len(batch)  # the repeats are dropped
    filled = pc.is_in(from_parts["span_id"], pa.array(sorted(stripped)))
    assert stripped and pc.sum(filled).as_py() > 0  # and the children kept, filled


def _fifo(part: Path, span_file: Path) -> None:
    os.mkfifo(part)


def _dev_zero(part: Path, span_file: Path) -> None:
    os.symlink("/dev/zero", part)


def _truncated(part: Path, span_file: Path) -> None:
    os.truncate(part, part.stat().st_size // 2)


def _other_schema(part: Path, span_file: Path) -> None:
    source = spec.part_source(span_file, span_file.read_bytes())  # current, of another table
    pq.write_table(pa.table({"name": ["x"]}).replace_schema_metadata(
        {spec.META_SOURCE: source}), part)


def _null_name(part: Path, span_file: Path) -> None:
    table = pq.read_table(part)
    name = spec.SCHEMA.get_field_index("name")
    pq.write_table(table.set_column(name, spec.SCHEMA.field(name),
                                    pa.nulls(table.num_rows, pa.string())), part)


def _stale(part: Path, span_file: Path) -> None:
    """The span file edited in place after its part was written, same name and size: its
    first span renamed."""
    text = span_file.read_bytes()
    name = json.loads(text)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["name"]
    span_file.write_bytes(text.replace(f'"name":"{name}"'.encode(),
                                       f'"name":"{name[:-1]}~"'.encode()))


def _of_another_file(part: Path, span_file: Path) -> None:
    (other,) = [p for p in part.parent.glob("*.parquet") if p != part][:1]
    shutil.copyfile(other, part)


BAD_PARTS = [_fifo, _dev_zero, _truncated, _other_schema, _null_name, _stale,
             _of_another_file]


@pytest.mark.parametrize("spoil", BAD_PARTS, ids=[f.__name__.strip("_") for f in BAD_PARTS])
def test_a_part_that_is_not_its_files_current_rows_is_passed_over_for_the_file(spoil,
                                                                              tmp_path):
    run = _replayed(RECORDED[0], tmp_path / "run")
    span_file = spantable.span_files(run)[-1]
    part = spec.part_of(span_file)
    if spoil in (_fifo, _dev_zero):
        part.unlink()
    spoil(part, span_file)
    assert spanstream.part_rows(span_file, span_file.read_bytes(), OFFSET) is None
    assert spantable.build(spantable.span_files(run), OFFSET).equals(
        _without_parts(run), check_metadata=True)


def test_a_stale_part_would_have_given_the_old_rows(tmp_path):
    """What _stale changes shows in the table: the edit keeps the file's size, so only the
    part's record of the file's bytes tells the part from a current one."""
    run = _replayed(RECORDED[0], tmp_path / "run")
    span_file = spantable.span_files(run)[-1]
    size = span_file.stat().st_size
    before = spantable.build([span_file], OFFSET)["name"]
    _stale(spec.part_of(span_file), span_file)
    assert span_file.stat().st_size == size
    assert not spantable.build([span_file], OFFSET)["name"].equals(before)


def _forged(part: Path) -> Path:
    """A part of the same file (its META_SOURCE) whose rows say otherwise: every name changed."""
    table = pq.read_table(part)
    name = spec.SCHEMA.get_field_index("name")
    forged = part.with_name("forged.parquet")
    names = pa.array([f"{n}-forged" for n in table["name"].to_pylist()], pa.string())
    pq.write_table(table.set_column(name, spec.SCHEMA.field(name), names), forged)
    return forged


def test_a_part_planted_by_another_user_is_not_read(shared_tmp, as_nobody):
    run = _replayed(RECORDED[0], shared_tmp / "run")
    span_file = spantable.span_files(run)[-1]
    part = spec.part_of(span_file)
    forged = _forged(part)
    shutil.copyfile(forged, part)  # ours: taken as the file's rows, unchecked
    assert "-forged" in spantable.build([span_file], OFFSET)["name"][0].as_py()

    part.unlink()
    for path, mode in ((run, 0o755), (run / rundir.SPANS_DIR, 0o755), (part.parent, 0o777),
                       (forged, 0o644)):
        path.chmod(mode)  # a run another user can write parts into (a copied run, say)
    as_nobody("cp", str(forged), str(part))
    assert part.stat().st_uid == 65534
    assert spanstream.part_rows(span_file, span_file.read_bytes(), OFFSET) is None
    assert spantable.build(spantable.span_files(run), OFFSET).equals(
        _without_parts(run), check_metadata=True)
