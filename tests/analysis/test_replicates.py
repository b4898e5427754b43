"""The interval across a study's repetitions and the one rule that reads it (ahead, behind,
level, unknown spread), on synthetic per-repetition frames."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from kvscope.analysis import replicates

KEYS = ["profile", "against", "phase", "metric"]


def per_rep(ratios: list[float], run: tuple[float, float] = (0.97, 1.08)) -> pd.DataFrame:
    """One comparison's rows, one per repetition, each with the same within-run interval."""
    return pd.DataFrame({"profile": "kvscope", "against": "kvscope-serial", "phase": "cold-c16",
                         "metric": "ttft", "rep": range(1, len(ratios) + 1), "ratio": ratios,
                         "run_lo": run[0], "run_hi": run[1]})


@pytest.mark.parametrize(("ratios", "standing"), [
    pytest.param([0.95, 1.02, 1.08], replicates.LEVEL, id="three-straddling-1-are-level"),
    pytest.param([1.30, 1.32, 1.35], replicates.ABOVE, id="three-clearly-above-1-are-ahead"),
    pytest.param([0.70, 0.72, 0.69], replicates.BELOW, id="three-clearly-below-1-are-behind"),
    pytest.param([1.30], replicates.UNKNOWN, id="one-repetition-has-unknown-spread"),
    pytest.param([1.04, 1.06], replicates.LEVEL, id="two-close-above-1-are-level-t-is-wide"),
])
def test_the_standing_follows_the_interval_across_repetitions(ratios, standing):
    [row] = replicates.across(per_rep(ratios), KEYS).to_dict("records")
    assert row["standing"] == standing and row["reps"] == len(ratios)
    assert row["ratios"] == tuple(ratios)


def test_a_single_run_whose_own_interval_excludes_1_still_claims_no_winner():
    """The case that flipped on a rerun: one run, its bootstrap over requests all above 1."""
    [row] = replicates.across(per_rep([1.07], run=(1.03, 1.11)), KEYS).to_dict("records")
    assert row["standing"] == replicates.UNKNOWN and math.isnan(row["rep_lo"])
    said = replicates.words(row)
    assert said.startswith("unknown spread (one repetition: no winner claimed")
    assert "--repeats 3" in said and "within one run 1.03-1.11" in said
    assert "ahead" not in said and "level" not in said


def test_three_repetitions_clearly_apart_are_called_ahead_with_every_figure():
    [row] = replicates.across(per_rep([1.30, 1.32, 1.35]), KEYS).to_dict("records")
    said = replicates.words(row, above="faster")
    assert said.startswith("faster: 1.32x, 95 % interval across 3 repetitions")
    assert "(each 1.30, 1.32, 1.35)" in said and "within one run 0.97-1.08" in said


def test_the_interval_is_a_t_interval_of_the_log_ratios():
    ratios = [0.95, 1.02, 1.08]
    logs = np.log(ratios)
    half = 4.303 * logs.std(ddof=1) / math.sqrt(3)
    s = replicates.spread(ratios)
    assert s.center == pytest.approx(math.exp(logs.mean()))
    assert (s.lo, s.hi) == pytest.approx((math.exp(logs.mean() - half),
                                          math.exp(logs.mean() + half)))


def test_the_rule_does_not_depend_on_which_way_round_a_ratio_is_written():
    ratios = [1.12, 0.97, 1.21, 1.05]
    s, inverse = replicates.spread(ratios), replicates.spread([1 / r for r in ratios])
    assert (inverse.lo, inverse.hi) == pytest.approx((1 / s.hi, 1 / s.lo))
    flipped = {replicates.ABOVE: replicates.BELOW, replicates.BELOW: replicates.ABOVE,
               replicates.LEVEL: replicates.LEVEL}
    assert replicates.standing(inverse) == flipped[replicates.standing(s)]


def test_a_repetition_without_a_ratio_is_left_out_of_the_count():
    s = replicates.spread([1.3, math.nan, 1.31, 0.0])
    assert s.reps == 2 and replicates.standing(s) == replicates.ABOVE
    assert replicates.spread([]).reps == 0
    assert replicates.standing(replicates.spread([math.nan])) == replicates.UNKNOWN


def test_a_bar_other_than_1_is_read_the_same_way():
    s = replicates.spread([1.40, 1.42, 1.45])  # a gate's min of 1.29
    assert replicates.standing(s, 1.29) == replicates.ABOVE
    assert replicates.standing(s, 1.42) == replicates.LEVEL
    assert replicates.standing(s, 1.60) == replicates.BELOW
    reduction = replicates.spread([0.69, 0.70, 0.71]).complement()  # 1 - candidate/baseline
    assert reduction.center == pytest.approx(0.30, abs=1e-3) and reduction.lo < 0.30 < reduction.hi


def test_comparisons_are_summarised_apart_and_in_repetition_order():
    frame = pd.concat([per_rep([1.30, 1.32, 1.35]),
                       per_rep([1.0, 0.9, 1.1]).assign(metric="requests_per_s")])
    summary = replicates.across(frame.sample(frac=1, random_state=0), KEYS)
    by = summary.set_index("metric")
    assert by.loc["ttft", "ratios"] == (1.30, 1.32, 1.35)
    assert by.loc["requests_per_s", "ratios"] == (1.0, 0.9, 1.1)
    assert by.loc["ttft", "standing"] == replicates.ABOVE
    assert by.loc["requests_per_s", "standing"] == replicates.LEVEL
    assert by.loc["ttft", "run_lo"] == 0.97


def test_a_frame_missing_a_column_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"lack columns \['run_hi'\]"):
        replicates.across(per_rep([1.0]).drop(columns="run_hi"), KEYS)


def test_t_quantiles_come_from_the_table_then_the_expansion():
    assert replicates.t95(1) == 12.706 and replicates.t95(2) == 4.303
    assert replicates.t95(30) == 2.042
    assert replicates.t95(40) == pytest.approx(2.021, abs=1e-3)
    assert replicates.t95(120) == pytest.approx(1.980, abs=1e-3)
    with pytest.raises(ValueError):
        replicates.t95(0)
