"""kvscope.tracer.config: each bad OTEL_*/KVSCOPE_* value gives one warning line, a fallback, a count;
the plugin's start-up line says whether tracing is on, where spans go and the sampler."""

from __future__ import annotations

import logging

import pytest

from kvscope.contract.env import ENV_CLOCK_OFFSET, ENV_SPANS_DIR
from kvscope.tracer import config, failsafe, pipeline, vllm_plugin
from kvscope.tracer.tail_sampling import TailRule

OTLP = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
TAIL = {"OTEL_TRACES_SAMPLER": "kvscope_tail"}


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(("env", "variable", "check"), [
    pytest.param({"OTEL_BSP_MAX_QUEUE_SIZE": "lots"}, "OTEL_BSP_MAX_QUEUE_SIZE",
                 lambda c: c.batch["max_queue_size"] == 2048, id="bsp-queue-not-int"),
    pytest.param({"OTEL_BSP_SCHEDULE_DELAY": "-5"}, "OTEL_BSP_SCHEDULE_DELAY",
                 lambda c: c.batch["schedule_delay_millis"] == config.FILE_FLUSH_MS,
                 id="bsp-delay-negative"),
    pytest.param({"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1e3"}, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
                 lambda c: c.batch["max_export_batch_size"] == 512, id="bsp-batch-float"),
    pytest.param({"OTEL_BSP_MAX_QUEUE_SIZE": "10", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "64"},
                 "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
                 lambda c: c.batch["max_export_batch_size"] == 10, id="bsp-batch-over-queue"),
    pytest.param({"OTEL_BSP_EXPORT_TIMEOUT": "soon"}, "OTEL_BSP_EXPORT_TIMEOUT",
                 lambda c: c.batch["export_timeout_millis"] == 30000, id="bsp-timeout"),
    pytest.param({**OTLP, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
                 "OTEL_EXPORTER_OTLP_PROTOCOL",
                 lambda c: c.otlp.protocol == "http/protobuf"
                 and c.otlp.url() == "http://127.0.0.1:4318/v1/traces", id="http-json"),
    pytest.param({**OTLP, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "udp"},
                 "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", lambda c: c.otlp is None,
                 id="protocol-unknown-otlp-off"),
    pytest.param({**OTLP, "OTEL_EXPORTER_OTLP_TIMEOUT": "ten"}, "OTEL_EXPORTER_OTLP_TIMEOUT",
                 lambda c: c.otlp.timeout_s == config.OTLP_TIMEOUT_S, id="otlp-timeout"),
    pytest.param({**OTLP, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "ten"},
                 "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", lambda c: c.otlp is None,
                 id="otlp-traces-timeout-otlp-off"),
    pytest.param({ENV_CLOCK_OFFSET: "abc"}, ENV_CLOCK_OFFSET,
                 lambda c: c.clock_offset_ns is None, id="clock-offset"),
    pytest.param({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER",
                 lambda c: c.sampler_name == config.DEFAULT_SAMPLER, id="sampler-name"),
    pytest.param({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                  "OTEL_TRACES_SAMPLER_ARG": "25%"}, "OTEL_TRACES_SAMPLER_ARG",
                 lambda c: c.sampler_arg == 1.0, id="sampler-arg"),
    pytest.param({**TAIL, "OTEL_TRACES_SAMPLER_ARG": "ttft_ms=fast,ratio=0.5"},
                 "OTEL_TRACES_SAMPLER_ARG", lambda c: c.tail == TailRule(ratio=0.5),
                 id="tail-ttft-not-a-number-the-good-pair-kept"),
    pytest.param({**TAIL, "OTEL_TRACES_SAMPLER_ARG": "ratio=2"}, "OTEL_TRACES_SAMPLER_ARG",
                 lambda c: c.tail == TailRule(), id="tail-ratio-over-1"),
    pytest.param({**TAIL, "OTEL_TRACES_SAMPLER_ARG": "percentile=nan,window=5"},
                 "OTEL_TRACES_SAMPLER_ARG", lambda c: c.tail == TailRule(),
                 id="tail-percentile-nan-window-too-small"),
    pytest.param({**TAIL, "OTEL_TRACES_SAMPLER_ARG": "0.01"}, "OTEL_TRACES_SAMPLER_ARG",
                 lambda c: c.tail == TailRule(), id="tail-bare-ratio"),
    pytest.param({**TAIL, "OTEL_TRACES_SAMPLER_ARG": "speed=fast,ratio=0.1,ratio=0.2"},
                 "OTEL_TRACES_SAMPLER_ARG", lambda c: c.tail == TailRule(ratio=0.1),
                 id="tail-unknown-and-twice"),
    pytest.param({ENV_SPANS_DIR: "/proc/kvscope-spans"}, ENV_SPANS_DIR,
                 lambda c: c.spans_dir is None, id="spans-dir-unwritable"),
    # Values that parse but no exporter can use: past int64, past what the SDK can wait or build.
    pytest.param({ENV_CLOCK_OFFSET: str(10**23)}, ENV_CLOCK_OFFSET,
                 lambda c: c.clock_offset_ns is None, id="clock-offset-huge"),
    pytest.param({"OTEL_BSP_SCHEDULE_DELAY": str(10**20)}, "OTEL_BSP_SCHEDULE_DELAY",
                 lambda c: c.batch["schedule_delay_millis"] == config.FILE_FLUSH_MS,
                 id="bsp-delay-huge"),
    pytest.param({"OTEL_BSP_MAX_QUEUE_SIZE": str(10**20)}, "OTEL_BSP_MAX_QUEUE_SIZE",
                 lambda c: c.batch["max_queue_size"] == 2048, id="bsp-queue-huge"),
    pytest.param({**OTLP, "OTEL_EXPORTER_OTLP_TIMEOUT": "inf"}, "OTEL_EXPORTER_OTLP_TIMEOUT",
                 lambda c: c.otlp.timeout_s == config.OTLP_TIMEOUT_S, id="otlp-timeout-inf"),
])
def test_a_bad_value_falls_back_with_one_line_and_one_count(env, variable, check, caplog):
    with caplog.at_level(logging.WARNING):
        settings = config.load(env)
        assert config.load(env) is settings, "parsed once per process"
        pipeline.build("test", "test", env).shutdown()  # the pipeline neither raises nor recounts
    assert check(settings)
    lines = _warnings(caplog)
    assert len(lines) == 1, lines
    assert variable in lines[0] and repr(env[variable]) in lines[0] and "using" in lines[0]
    assert failsafe.counts() == {failsafe.CONFIG + variable: 1}


def test_good_values_are_used_and_say_nothing(caplog, tmp_path):
    env = {"OTEL_BSP_MAX_QUEUE_SIZE": "64", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "16",
           "OTEL_BSP_SCHEDULE_DELAY": "5000", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT":
           "http://c:4318/v1/traces", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "2.5", ENV_CLOCK_OFFSET: "-42",
           ENV_SPANS_DIR: str(tmp_path / "spans")}
    with caplog.at_level(logging.WARNING):
        settings = config.load(env)
    assert _warnings(caplog) == [] and failsafe.counts() == {}
    assert settings.batch == {"max_queue_size": 64, "max_export_batch_size": 16,
                              "schedule_delay_millis": 5000, "export_timeout_millis": 30000}
    assert settings.otlp == config.Otlp("http://c:4318/v1/traces", "http/protobuf", 2.5, True)
    assert settings.clock_offset_ns == -42 and settings.spans_dir == tmp_path / "spans"
    assert settings.destinations() == [f"files in {tmp_path / 'spans'}",
                                       "OTLP http/protobuf to http://c:4318/v1/traces"]


def test_start_up_line_says_on_where_and_sampler(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv(vllm_plugin.ENV_TRACING, "1")
    monkeypatch.setenv(ENV_SPANS_DIR, str(tmp_path))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.01")
    line = _plugin_lines(monkeypatch, caplog)
    assert len(line) == 1, line
    assert "on in pid" in line[0] and f"files in {tmp_path}" in line[0]
    assert "OTLP grpc to http://collector:4317" in line[0]
    assert "parentbased_traceidratio (ratio 0.01)" in line[0]


def test_start_up_line_says_why_nothing_will_be_exported(monkeypatch, caplog):
    monkeypatch.setenv(vllm_plugin.ENV_TRACING, "1")
    for name in (ENV_SPANS_DIR, "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    line = _plugin_lines(monkeypatch, caplog)
    assert len(line) == 1 and "nothing will be exported" in line[0], line
    assert ENV_SPANS_DIR in line[0] and "OTEL_EXPORTER_OTLP_" in line[0]


def test_vllm_plugins_without_the_tracing_plugin_is_said(monkeypatch, caplog):
    monkeypatch.setenv(vllm_plugin.ENV_TRACING, "1")
    monkeypatch.setenv("VLLM_PLUGINS", "kvscope_cpu_connector")
    with caplog.at_level(logging.WARNING, logger=vllm_plugin.logger.name):
        vllm_plugin.warn_if_not_loaded()
        monkeypatch.setenv("VLLM_PLUGINS", "kvscope_cpu_connector,kvscope_tracing")
        vllm_plugin.warn_if_not_loaded()
    lines = _warnings(caplog)
    assert len(lines) == 1 and "VLLM_PLUGINS='kvscope_cpu_connector'" in lines[0], lines
    assert "kvscope_tracing" in lines[0]


def test_a_tracing_switch_that_is_neither_1_nor_0_is_said(monkeypatch, caplog):
    monkeypatch.setenv(vllm_plugin.ENV_TRACING, "true")
    with caplog.at_level(logging.INFO, logger=vllm_plugin.logger.name):
        vllm_plugin.register()
    lines = _warnings(caplog)
    assert len(lines) == 1 and "KVSCOPE_TRACING='true'" in lines[0], lines


def _plugin_lines(monkeypatch, caplog) -> list[str]:
    """register() in this process (instrumenting nothing: no vLLM module is imported here)."""
    from kvscope.tracer import instrumentor

    monkeypatch.setattr(instrumentor.KvscopeInstrumentor, "instrument", lambda self: None)
    with caplog.at_level(logging.INFO, logger=vllm_plugin.logger.name):
        vllm_plugin.register()
    return [r.getMessage() for r in caplog.records if r.name == vllm_plugin.logger.name]
