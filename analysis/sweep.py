"""Sweep line over labelled intervals: which labels are active in every elementary segment.

The attribution's one algorithm (the sweep line trace analysers such as HolisticTraceAnalysis
use for overlapping kernels): turn every interval into a +1 and a -1 event,
sort the events by (key, time), and keep a running count per label. Between two consecutive
events of the same key the set of active labels is constant; that stretch is a segment. The
running counts are one global cumsum because each key's events open and close within the key.
Ties need no care: events at the same time make zero-length segments, which weigh nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Segments:
    """Elementary segments: owning key, start and length (ns), the active labels (bool matrix).

    A key's segments are sorted by start and tile its span from first to last event.
    """

    key: np.ndarray  # int64, per segment
    start: np.ndarray  # int64 ns, per segment
    length: np.ndarray  # int64 ns, per segment
    active: np.ndarray  # bool, segments x labels


def segments(key: np.ndarray, start: np.ndarray, end: np.ndarray, label: np.ndarray,
             n_labels: int) -> Segments:
    """Cut the intervals [start, end) (grouped by `key`, tagged by `label`) into segments.

    Intervals with end <= start are ignored. Only segments of positive length are returned.
    """
    keep = end > start
    key, start, end, label = key[keep], start[keep], end[keep], label[keep]
    ev_key = np.concatenate([key, key])
    ev_time = np.concatenate([start, end])
    ev_label = np.concatenate([label, label])
    ev_delta = np.concatenate([np.ones(len(key), np.int32), -np.ones(len(key), np.int32)])
    order = np.lexsort((ev_time, ev_key))
    ev_key, ev_time, ev_label, ev_delta = (a[order] for a in (ev_key, ev_time, ev_label, ev_delta))
    running = np.zeros((len(ev_key), n_labels), dtype=np.int32)  # open intervals per label
    running[np.arange(len(ev_key)), ev_label] = ev_delta
    active = np.cumsum(running, axis=0, out=running) > 0
    length = np.zeros(len(ev_key), dtype=np.int64)
    if len(ev_key) > 1:
        same = ev_key[1:] == ev_key[:-1]
        length[:-1] = np.where(same, ev_time[1:] - ev_time[:-1], 0)
    positive = length > 0
    return Segments(ev_key[positive], ev_time[positive], length[positive], active[positive])


def per_key_sum(seg_key: np.ndarray, length: np.ndarray, mask: np.ndarray, n_keys: int) -> np.ndarray:
    """Total length of the masked segments of each key, exact in int64.

    float64 bincount is exact here: every addend and partial sum is an integer below 2**53 ns.
    """
    sums = np.bincount(seg_key[mask], weights=length[mask], minlength=n_keys)
    return np.rint(sums).astype(np.int64)
