"""`--api-server-count`: the `auto` rule and bad values, what the launcher asks the supervisor
to run for N gateway processes (the spec, no process started), and the metrics they share:
child processes in prometheus_client's multiprocess mode write, this one scrapes."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.cli.launcher import MeshConfig, resolve_api_server_count
from services.cli.main import _serve_parser, main
from services.common.metrics import exposition, forget_exited_processes, multiprocess_registry
from tests.unit.test_kvstore_launch import _args_of, _flag, _mesh, cleanup  # noqa: F401 - fixture

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("cores,count", [(1, 1), (2, 1), (8, 1), (15, 1), (16, 2), (24, 3), (32, 4), (128, 4)])
def test_auto_is_one_gateway_per_eight_cores_between_one_and_four(cores, count):
    assert resolve_api_server_count("auto", cores) == count


def test_this_small_host_gets_one_gateway_by_default():
    if len(os.sched_getaffinity(0)) < 16:
        assert _serve_parser("meshllm serve", with_model=False).parse_args([]).api_server_count == 1


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "two", ""])
def test_bad_counts_are_refused_with_the_flag_named(value):
    with pytest.raises(ValueError, match="--api-server-count"):
        resolve_api_server_count(value, 64)


def test_the_command_refuses_a_bad_count_before_anything_starts(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "/nowhere", "--api-server-count", "0"])
    assert exit_.value.code == 2
    assert "--api-server-count: must be >= 1" in capsys.readouterr().err


def test_the_mesh_config_refuses_a_count_below_one(smollm2_dir):
    with pytest.raises(ValueError, match="--api-server-count"):
        MeshConfig(model_dir=str(smollm2_dir), simulate_worker=True, api_server_count=0)


def test_one_gateway_is_started_as_before(smollm2_dir, cleanup):  # noqa: F811
    mesh = _mesh(smollm2_dir, "--api-server-count", "1", "--port", "0")
    cleanup(mesh)
    gateways = [r for r in mesh._replicas() if r.id.startswith("gateway")]
    assert [r.id for r in gateways] == ["gateway-0"]
    args = list(gateways[0].processes[0].args)
    assert "--reuse-port" not in args and _flag(args, "--port") == "0"
    assert "PROMETHEUS_MULTIPROC_DIR" not in gateways[0].processes[0].env
    assert not mesh.gateway_metrics_dir


def test_n_gateways_share_the_ports_and_each_has_its_own_health_port(smollm2_dir, cleanup):  # noqa: F811
    mesh = _mesh(smollm2_dir, "--api-server-count", "3", "--port", "0", "--grpc-port", "0")
    cleanup(mesh)
    spec = mesh._replicas()
    assert [r.id for r in spec][-3:] == ["gateway-0", "gateway-1", "gateway-2"]   # stopped first
    gateways = _args_of(spec, "gateway")
    # Port 0 is chosen once by the launcher and given to every process.
    assert mesh.http_port and mesh.grpc_port
    assert {_flag(a, "--port") for a in gateways} == {str(mesh.http_port)}
    assert {_flag(a, "--grpc-port") for a in gateways} == {str(mesh.grpc_port)}
    assert all("--reuse-port" in a for a in gateways)
    assert len({_flag(a, "--health-port") for a in gateways}) == 3
    # The same routing view: the same engines, tokenizers and supervisor.
    for flag in ("--engine-addr", "--tokenizer-addr", "--supervisor-addr"):
        assert len({_flag(a, flag) for a in gateways}) == 1
    envs = [p.env for r in spec for p in r.processes if p.module == "gateway"]
    assert {e["PROMETHEUS_MULTIPROC_DIR"] for e in envs} == {mesh.gateway_metrics_dir}
    assert os.path.isdir(mesh.gateway_metrics_dir)
    assert [bool(r.metrics_url) for r in spec if r.id.startswith("gateway")] == [True, False, False]
    assert "gateway-health-2=" in mesh.services_line()


# ---- shared metrics ----------------------------------------------------------------------------

_WRITER = textwrap.dedent("""
    import sys
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from services.common.metrics import CollectorMirror
    from services.gateway.http import metrics

    requests, routable, load, replica = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    for _ in range(requests):
        metrics.record_http("POST", "/v1/completions", 200, 0.02, None)
    metrics.track_inflight("m", lambda: load)
    metrics.write_tracked_gauges()

    class Pool:
        def collect(self):
            r = GaugeMetricFamily("meshllm:engine_replica_routable", "routable", labels=["replica"])
            r.add_metric([replica], routable)
            t = GaugeMetricFamily("meshllm:engine_replica_outstanding_tokens", "tokens", labels=["replica"])
            t.add_metric([replica], load)
            c = CounterMetricFamily("meshllm:gateway_routed_requests", "routed", labels=["reason"])
            c.add_metric(["least_loaded"], requests)
            yield from (r, t, c)

    mirror = CollectorMirror(sys.argv[5], {"meshllm:engine_replica_routable": "max",
                                           "meshllm:engine_replica_outstanding_tokens": "sum"})
    mirror.add(Pool())
    mirror.sync()
    mirror.sync()   # a second copy of the same totals adds nothing
    print("synced", flush=True)
    sys.stdin.read()   # alive until the test closes stdin
""")


def _writer(path: str, *argv) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _WRITER, *map(str, argv), path], cwd=ROOT,
                         env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": path},
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "synced"
    return p


def _scrape(path: str) -> dict[tuple[str, tuple], float]:
    body, _ = exposition(None, multiprocess_registry(path))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def test_counters_add_up_over_processes_and_outlive_them_while_gauges_follow_the_live_ones(tmp_path):
    path = str(tmp_path)
    first, second = _writer(path, 3, 1, 100, "engine-0"), _writer(path, 4, 0, 50, "engine-0")
    try:
        seen = _scrape(path)
        assert seen[("meshllm:http_requests_total",
                     (("method", "POST"), ("route", "/v1/completions"), ("status", "200")))] == 7
        assert seen[("meshllm:http_request_duration_seconds_count",
                     (("method", "POST"), ("route", "/v1/completions")))] == 7
        assert seen[("meshllm:gateway_routed_requests_total", (("reason", "least_loaded"),))] == 7
        assert seen[("meshllm:gateway_requests_inflight", (("model_name", "m"),))] == 150
        assert seen[("meshllm:engine_replica_outstanding_tokens", (("replica", "engine-0"),))] == 150
        assert seen[("meshllm:engine_replica_routable", (("replica", "engine-0"),))] == 1
        assert not any(name.startswith(("process_", "python_")) for name, _ in seen)

        first.stdin.close()
        first.wait(10)
        assert forget_exited_processes(path) == [first.pid]
        seen = _scrape(path)
        assert seen[("meshllm:http_requests_total",
                     (("method", "POST"), ("route", "/v1/completions"), ("status", "200")))] == 7
        assert seen[("meshllm:gateway_routed_requests_total", (("reason", "least_loaded"),))] == 7
        assert seen[("meshllm:gateway_requests_inflight", (("model_name", "m"),))] == 50
        assert seen[("meshllm:engine_replica_routable", (("replica", "engine-0"),))] == 0
    finally:
        for p in (first, second):
            if p.poll() is None:
                p.stdin.close()
                p.wait(10)


def test_a_gauge_series_a_process_stops_reporting_is_gone(tmp_path):
    from prometheus_client.core import GaugeMetricFamily

    from services.common.metrics import CollectorMirror
    replicas = ["127.0.0.1:5000"]

    class Pool:
        def collect(self):
            fam = GaugeMetricFamily("meshllm:engine_replica_routable", "routable", labels=["replica"])
            for r in replicas:
                fam.add_metric([r], 1.0)
            yield fam

    mirror = CollectorMirror(str(tmp_path), {"meshllm:engine_replica_routable": "max"})
    mirror.add(Pool())
    mirror.sync()
    replicas[:] = ["engine-0"]   # the supervisor's ids replace the configured addresses
    mirror.sync()
    routable = {k: v for k, v in _scrape(str(tmp_path)).items() if k[0] == "meshllm:engine_replica_routable"}
    assert routable == {("meshllm:engine_replica_routable", (("replica", "engine-0"),)): 1.0}
    mirror.close()
    assert not _scrape(str(tmp_path))


def test_a_gauge_without_a_merge_rule_is_refused(tmp_path):
    from prometheus_client.core import GaugeMetricFamily

    from services.common.metrics import CollectorMirror

    class One:
        def collect(self):
            yield GaugeMetricFamily("meshllm:unmerged", "x", value=1.0)

    mirror = CollectorMirror(str(tmp_path), {})
    mirror.add(One())
    with pytest.raises(ValueError, match="merge rule"):
        mirror.sync()
    with pytest.raises(ValueError, match="merges must be one of"):
        CollectorMirror(str(tmp_path), {"meshllm:x": "avg"})
