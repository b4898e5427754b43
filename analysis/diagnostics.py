"""Per-request diagnostics: what makes an attribution row partial, in words.

A row is `partial` when its numbers are known to be incomplete or doubtful (no spans, missing
stages, skewed clocks, duplicate spans or ids, reads that cannot be joined to the disk). Plain
remarks that do not make the numbers doubtful (no block I/O for a read that the page cache
served) are written too, without the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvscope.contract import semconv


@dataclass(frozen=True)
class Facts:
    """What attribution learned while joining; input to `describe`."""

    requests: pd.DataFrame
    spans: pd.DataFrame  # component spans with key and label
    reads: pd.DataFrame  # the storage.read rows of spans
    joinable: np.ndarray  # per row of `reads`: it can be joined to block I/O (blockjoin)
    io: pd.DataFrame  # joined block I/O (blockjoin.join)
    outside_ns: np.ndarray  # per request, farthest reach of a span outside the window
    notes: dict[str, list[str]]  # request_id -> problems found while loading
    no_process: np.ndarray  # per request: worker spans, none with a process.pid (analysis.batch)


def succeeded(requests: pd.DataFrame) -> np.ndarray:
    """Requests with status ok and a first token at or after arrival."""
    first = requests["first_token_ns"].to_numpy(np.int64)
    return ((requests["status"].astype(str) == "ok").to_numpy() & (first >= 0)
            & (first >= requests["arrival_ns"].to_numpy(np.int64)))


def describe(facts: Facts, skew_tolerance_ns: int, have_block_io: bool) -> tuple[pd.Series, pd.Series]:
    """(partial flags, '; '-joined diagnostics) per request."""
    n = len(facts.requests)
    ok = succeeded(facts.requests)
    counts = _per_key_counts(facts.spans, n)
    ids = facts.requests["request_id"].astype(str)
    doubtful = [
        (~ok, "request failed (" + facts.requests["error"].astype(str) + "): no attribution"),
        (ids.duplicated(keep=False).to_numpy(),
         "request_id repeats in requests.parquet: its spans went to the first row"),
        (ok & (counts["all"] == 0),
         "no component spans (tracer off or spans lost): the whole TTFT is `other`"),
        (ok & (counts["all"] > 0) & (counts[semconv.SPAN_QUEUE] == 0),
         f"no {semconv.SPAN_QUEUE} span: queueing is counted as `other`"),
        (ok & (counts["all"] > 0) & (counts[semconv.SPAN_PREFILL] == 0),
         f"no {semconv.SPAN_PREFILL} span: prefill is counted as `other`"),
        (ok & (facts.outside_ns > skew_tolerance_ns),
         pd.Series(facts.outside_ns / 1e6).map("spans reach {:.3f} ms outside [arrival, first "
                                               "token] (skewed clocks?); clipped".format)),
        (ids.isin(list(facts.notes)).to_numpy(),
         ids.map(lambda rid: "; ".join(facts.notes.get(rid, []))) if facts.notes else ""),
    ]
    untied = _unjoinable_reads(facts, n)
    if have_block_io:
        doubtful.append((ok & (untied > 0), pd.Series(untied).map(
            "{} storage.read spans carry neither chunk extents nor kvscope.storage.reader_tids: "
            "their disk time is not joined".format)))
    remarks = _remarks(facts, n, ok, untied, have_block_io)
    partial = np.zeros(n, dtype=bool)
    for mask, _ in doubtful:
        partial |= mask
    return pd.Series(partial), _join(n, doubtful + remarks)


def _per_key_counts(spans: pd.DataFrame, n: int) -> dict[str, np.ndarray]:
    keys = spans["key"].to_numpy()
    counts = {"all": np.bincount(keys, minlength=n)}
    for name in (semconv.SPAN_QUEUE, semconv.SPAN_PREFILL):
        counts[name] = np.bincount(keys[(spans["name"] == name).to_numpy()], minlength=n)
    return counts


def _unjoinable_reads(facts: Facts, n: int) -> np.ndarray:
    """Per request, its storage.read spans that say neither where nor by which thread they
    read: their block I/O cannot be joined."""
    keys = facts.reads["key"].to_numpy(np.int64)[~facts.joinable]
    return np.bincount(keys, minlength=n)


def _remarks(facts: Facts, n: int, ok: np.ndarray, untied: np.ndarray,
             have_block_io: bool) -> list[tuple[np.ndarray, object]]:
    """Notes that do not make the numbers doubtful."""
    ios = np.bincount(facts.io["key"].to_numpy(), minlength=n)
    ambiguous = np.bincount(facts.io["key"].to_numpy()[facts.io["ambiguous"].to_numpy(bool)],
                            minlength=n)
    reads = np.bincount(facts.reads["key"].to_numpy(), minlength=n)
    return [
        (ok & have_block_io & (reads > untied) & (ios == 0),
         "its storage reads matched no block I/O (page-cache hits?): storage time is software"),
        (ok & (ambiguous > 0), pd.Series(ambiguous).map(
            "{} block I/Os could be another request's too (the same sectors read by two "
            "requests at once, or overlapping reads of one thread); each went to the read that "
            "started last".format)),
        (ok & facts.no_process,
         "its worker spans carry no process.pid resource attribute: time spent waiting on "
         "other requests of the same worker cannot be told apart and stays in `other`"),
    ]


def _join(n: int, messages: list[tuple[np.ndarray, object]]) -> pd.Series:
    text = pd.Series([""] * n, dtype="str")
    for mask, message in messages:
        mask = np.asarray(mask, dtype=bool)
        if not mask.any():
            continue
        words = message if isinstance(message, str) else pd.Series(message).astype(str).to_numpy()
        piece = pd.Series(np.broadcast_to(words, n)).where(mask, "")
        sep = pd.Series(np.where((text != "").to_numpy() & mask, "; ", ""))
        text = text + sep + piece
    return text
