"""Tracing: off by default without loading the SDK; OTEL_* configuration; parent-based
sampling whose ratio changes at run time; the worker's bounded step spans."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.common import telemetry
from tests.integration.otlp_receiver import OtlpReceiver

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


def test_tracing_off_imports_no_sdk_and_does_nothing():
    code = """
import sys
from services.common import telemetry
import services.gateway.main, services.gateway.tracing, services.tokenizer.server, services.scheduler.server
import services.worker.step_tracing, services.common.grpc_tracing
rest = telemetry.init_service("gateway", ["--port", "1"])
assert rest == ["--port", "1"] and not telemetry.ENABLED
assert telemetry.start_span("x", root=True) is None and telemetry.current_trace_id() is None
assert telemetry.grpc_metadata() is None and telemetry.traceparent_of(None) == ("", "")
assert telemetry.set_trace_sampling_ratio(0.25) == 1.0 and telemetry.get_trace_sampling_ratio() == 0.25
# (fastapi itself imports the OpenTelemetry API; the SDK and exporter are ours to avoid.)
print(sorted(m for m in sys.modules if m.startswith(
    ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto", "services.common.tracing_sdk"))))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_clean_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_flags_win_over_otel_environment():
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "collector:4317", "OTEL_TRACES_SAMPLER_ARG": "0.2",
           "OTEL_EXPORTER_OTLP_HEADERS": "api-key=a%20b,x-tenant=t1", "OTEL_BSP_SCHEDULE_DELAY": "250"}
    rest, cfg = telemetry.split_tracing_args("scheduler", ["--port", "5", "--trace-sampling-ratio", "0.7"], env)
    assert rest == ["--port", "5"]
    assert (cfg.endpoint, cfg.sampling_ratio, cfg.schedule_delay_ms) == ("collector:4317", 0.7, 250)
    assert cfg.headers == (("api-key", "a b"), ("x-tenant", "t1")) and cfg.insecure
    _, cfg = telemetry.split_tracing_args("scheduler", ["--otlp-traces-endpoint=https://otel:4317"], env)
    assert cfg.endpoint == "https://otel:4317" and cfg.sampling_ratio == 0.2 and not cfg.insecure
    _, cfg = telemetry.split_tracing_args("scheduler", [], {**env, "OTEL_SDK_DISABLED": "true"})
    assert cfg.endpoint is None
    _, cfg = telemetry.split_tracing_args("scheduler", [], {})
    assert cfg.endpoint is None and cfg.sampling_ratio == 1.0


@pytest.mark.parametrize("argv,env", [(["--trace-sampling-ratio", "1.5"], {}),
                                      (["--trace-sampling-ratio", "nan"], {}),
                                      (["--trace-sampling-ratio", "x"], {}),
                                      ([], {"OTEL_TRACES_SAMPLER_ARG": "-0.1"}),
                                      ([], {"OTEL_EXPORTER_OTLP_HEADERS": "novalue"}),
                                      ([], {"OTEL_BSP_SCHEDULE_DELAY": "soon"})])
def test_bad_tracing_settings_are_refused(argv, env):
    with pytest.raises(ValueError):
        telemetry.split_tracing_args("gateway", argv, env)


@pytest.mark.parametrize("ratio", [-0.01, 1.01, float("nan"), "half", None])
def test_set_trace_sampling_ratio_rejects_out_of_range(ratio):
    before = telemetry.get_trace_sampling_ratio()
    with pytest.raises(ValueError):
        telemetry.set_trace_sampling_ratio(ratio)
    assert telemetry.get_trace_sampling_ratio() == before


def test_runtime_ratio_parent_based_sampling_and_bounded_worker_spans():
    with OtlpReceiver() as rx:
        out = subprocess.run([sys.executable, "-m", "tests.unit.tracing_child", rx.endpoint], cwd=ROOT,
                             env=_clean_env(), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        seen = json.loads(out.stdout.strip().splitlines()[-1])
        # shutdown_tracing flushed before the child exited: everything is here already.
        spans = rx.spans
    assert seen["ratio1_sampled"] == 10 and seen["previous_ratio"] == 1.0
    assert seen["ratio0_sampled"] == 0 and seen["child_sampled"]
    assert not seen["orphan"] and not seen["unsampled_parent"] and not seen["malformed_parent"]
    assert 1700 < seen["half_sampled"] < 2300  # 4000 draws at 0.5: 2000 +- 10 sigma
    names = [s.name for s in spans]
    assert names.count("ratio1") == 10 and names.count("child") == 1 and names.count("sched") == 1
    assert not {"ratio0", "orphan", "half", "x"} & set(names)
    assert all(s.service == "meshllm-unit" for s in spans)

    prefills = [s for s in spans if s.name == "worker.prefill"]
    steps = [s for s in spans if s.name == "worker.decode_step"]
    assert all(s.parent_span_id == seen["sched_span_id"] for s in prefills + steps)
    r1 = next(s for s in prefills if s.attributes["meshllm.request_id"] == "r1")
    assert r1.attributes["meshllm.prefill_chunks"] == 3 and (r1.start_ns, r1.end_ns) == (1_000, 6_000)
    assert len(prefills) == 6 and "u" not in {s.attributes["meshllm.request_id"] for s in prefills}
    # r1's 10 decode steps, one span per 4: the 1st, 5th and 9th.
    r1_steps = sorted(s.attributes["meshllm.steps_since_first_token"] for s in steps
                      if s.attributes["meshllm.request_id"] == "r1")
    assert r1_steps == [1, 5, 9]
    # Five traced requests decoding in one step, at most two step spans per step.
    assert len([s for s in steps if s.attributes["meshllm.step_id"] == 21]) == 2
    assert seen["resident_before_finish"] == 6 and seen["resident_after_finish"] == 0
