"""`meshllm bench serve` / `compare` against the real mesh and a simulated-worker mesh."""
import json
import subprocess
import sys

import pytest

from tests.integration.meshproc import ROOT, free_port, start_mesh

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.main", "bench", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_bench_run_against_the_mesh_writes_valid_json_and_a_png(mesh, smollm2_dir, tmp_path):
    out = tmp_path / "run.json"
    p = bench("serve", "--base-url", mesh.http_url, "--model", mesh.model_name, "--tokenizer", str(smollm2_dir),
              "--num-prompts", "6", "--max-concurrency", "3", "--random-input-len", "16",
              "--random-output-len", "4", "--ignore-eos", "--goodput", "ttft:60000", "--result-file", str(out))
    assert p.returncode == 0, p.stderr
    assert "Serving Benchmark Result" in p.stdout
    result = json.loads(out.read_text())
    assert result["schema"] == "meshllm.bench.serve/1" and result["model"] == mesh.model_name
    (run,) = result["runs"]
    assert (run["completed"], run["failed"], run["max_concurrency"]) == (6, 0, 3)
    assert run["total_input_tokens"] == 6 * 16 and run["total_output_tokens"] == 6 * 4
    assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"] <= run["e2el_ms"]["p99"]
    assert run["tpot_ms"]["mean"] > 0 and run["goodput"] == pytest.approx(run["request_throughput"])
    png = tmp_path / "run-latency-cdf.png"
    assert png.read_bytes()[:8] == PNG_MAGIC

    cmp = bench("compare", str(out), str(out))
    assert cmp.returncode == 0, cmp.stderr
    assert "1.000" in cmp.stdout and "requests/s" in cmp.stdout


def test_grpc_backend_and_chat_conversations_work(mesh, tmp_path):
    out = tmp_path / "grpc.json"
    p = bench("serve", "--backend", "meshllm-grpc", "--base-url", mesh.grpc_addr, "--dataset-name",
              "sharegpt-sample", "--sharegpt-output-len", "3", "--num-prompts", "4", "--request-rate", "50",
              "--no-plot", "--result-file", str(out))
    assert p.returncode == 0, p.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["completed"] == 4 and run["request_rate"] == 50
    p = bench("serve", "--backend", "openai-chat", "--base-url", mesh.http_url, "--dataset-name",
              "sharegpt-sample", "--sharegpt-output-len", "3", "--num-prompts", "3", "--disable-tqdm")
    assert p.returncode == 0, p.stderr
    assert "Successful requests:                             3" in p.stdout


def _one_line_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode not in (0, None)
    assert "Traceback" not in p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("meshllm bench: error:")
    return lines[0]


def test_unreachable_endpoint_is_one_clear_line():
    port = free_port()
    line = _one_line_error(bench("serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m",
                                 "--num-prompts", "1", timeout=60))
    assert f"127.0.0.1:{port}" in line and "connect" in line.lower()


def test_unknown_model_is_one_clear_line(mesh):
    line = _one_line_error(bench("serve", "--base-url", mesh.http_url, "--model", "no-such-model",
                                 "--num-prompts", "1", timeout=60))
    assert "no-such-model" in line and "404" in line


def test_compare_rejects_a_file_that_is_not_a_result(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    _one_line_error(bench("compare", str(bad), str(bad)))


def test_bench_against_a_simulated_worker_mesh(smollm2_dir, tmp_path):
    m = start_mesh(str(smollm2_dir), "--simulate-worker", "--simulate-step-ms", "2", "--max-model-len", "1024")
    try:
        worker = next(pid for pid in m.service_pids()
                      if b"services.worker" in open(f"/proc/{pid}/cmdline", "rb").read())
        maps = open(f"/proc/{worker}/maps").read()
        assert "libtorch" not in maps, "the simulated worker must not load torch"
        out = tmp_path / "sim.json"
        p = bench("serve", "--base-url", m.http_url, "--tokenizer", str(smollm2_dir), "--num-prompts", "32",
                  "--max-concurrency", "16", "--random-input-len", "24", "--random-output-len", "16",
                  "--ignore-eos", "--no-plot", "--result-file", str(out))
        assert p.returncode == 0, p.stderr
        (run,) = json.loads(out.read_text())["runs"]
        assert run["completed"] == 32 and run["total_output_tokens"] == 32 * 16
        assert run["itl_ms"]["mean"] is not None and run["tpot_ms"]["mean"] >= 1.0  # >= the step time, roughly
    finally:
        assert m.stop() == 0
