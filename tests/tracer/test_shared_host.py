"""Issue 19: a tracer in a root process on a host other users share plants nothing for them
and follows nothing of theirs. The attacker is a real second user (uid 65534).

Before: the spans directory was only checked to be writable, so one prepared by another user
was written into (spans readable by them, their planted links written through: two root-only
files overwritten with span JSON), and KVSCOPE_METRICS_DIR was used as found. Now such a
directory is refused at start-up in one line naming it, its owner and mode, and the fix; that
output is off and the rest of tracing goes on.
"""

from __future__ import annotations

import logging
import os

import pytest

from kvscope.tracer import config, failsafe, metrics, pipeline

pytestmark = [pytest.mark.root]


def _export_one_span(env: dict[str, str]) -> pipeline.Pipeline:
    """A pipeline as a vLLM process builds it, one span ended and flushed, shut down."""
    pipe = pipeline.build("test", "vllm", env)
    pipe.provider.get_tracer("test").start_span("kvscope.queue").end()
    pipe.flush()
    pipe.shutdown()
    return pipe


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_spans_directory_prepared_by_another_user_is_refused_and_nothing_written(
        shared_tmp, as_nobody, tmp_path, caplog):
    victim_dir = tmp_path / "root-only"
    victim_dir.mkdir(mode=0o700)
    victims = [victim_dir / "a", victim_dir / "b"]
    for victim in victims:
        victim.write_text("secret")
        victim.chmod(0o600)
    spans = shared_tmp / "kvscope-spans"
    as_nobody("mkdir", "-m", "777", str(spans))
    as_nobody("ln", "-s", str(victim_dir), str(spans / pipeline.STATS_DIR))
    for n in range(4):  # the names the exporter and the stats file would write
        as_nobody("ln", "-s", str(victims[n % 2]), str(spans / f"vllm-{os.getpid()}-{n:05d}.json"))
    before = sorted(p.name for p in spans.iterdir())
    with caplog.at_level(logging.WARNING):
        pipe = _export_one_span({config.ENV_SPANS_DIR: str(spans)})
    assert pipe.config.spans_dir is None and pipe.exporters == []
    assert [v.read_text() for v in victims] == ["secret", "secret"]
    assert sorted(p.name for p in spans.iterdir()) == before, "root created nothing there"
    assert sorted(os.listdir(victim_dir)) == ["a", "b"]
    (line,) = _warnings(caplog)
    assert str(spans) in line and "uid 65534" in line and "mode 0777" in line
    assert "file export off" in line and "a directory of this process's user" in line
    assert failsafe.counts() == {failsafe.CONFIG + config.ENV_SPANS_DIR: 1}


@pytest.mark.parametrize("link", [False, True], ids=["parent-of-another-user",
                                                   "parent-a-link-of-another-user-to-ours"])
def test_a_spans_directory_under_a_parent_another_user_controls_is_refused(
        shared_tmp, as_nobody, tmp_path, caplog, link):
    ours = tmp_path / "root-only"
    ours.mkdir(mode=0o700)
    if link:
        as_nobody("ln", "-s", str(ours), str(shared_tmp / "theirs"))
    else:
        as_nobody("mkdir", "-m", "755", str(shared_tmp / "theirs"))
    spans = shared_tmp / "theirs" / "spans"
    with caplog.at_level(logging.WARNING):
        settings = config.load({config.ENV_SPANS_DIR: str(spans)})
    assert settings.spans_dir is None
    assert not os.path.lexists(spans), "nothing made below a parent they control"
    assert os.listdir(ours) == []
    (line,) = _warnings(caplog)
    assert f"{shared_tmp / 'theirs'}" in line and "uid 65534" in line


def test_a_metrics_directory_of_another_user_turns_only_the_stage_metrics_off(
        shared_tmp, as_nobody, monkeypatch, caplog):
    planted = shared_tmp / "kvscope-metrics"
    as_nobody("mkdir", "-m", "777", str(planted))
    monkeypatch.setenv(metrics.ENV_METRICS_DIR, str(planted))
    monkeypatch.delenv(metrics.ENV_PROMETHEUS_MULTIPROC, raising=False)
    with caplog.at_level(logging.WARNING):
        assert metrics.stage_metrics(lambda: []) is None
    assert os.listdir(planted) == []
    (line,) = _warnings(caplog)
    assert str(planted) in line and "uid 65534" in line and "stage metrics are off" in line
    assert failsafe.counts() == {failsafe.CONFIG + metrics.ENV_METRICS_DIR: 1}


def test_a_private_spans_directory_of_ours_is_made_0700_and_used(tmp_path):
    spans = tmp_path / "spans"
    pipe = _export_one_span({config.ENV_SPANS_DIR: str(spans)})
    assert pipe.exporters == ["file"]
    assert oct(spans.stat().st_mode & 0o777) == "0o700"
    assert len(list(spans.glob("vllm-*.json"))) == 1
    assert len(list((spans / pipeline.STATS_DIR).glob("vllm-*.json"))) == 1
