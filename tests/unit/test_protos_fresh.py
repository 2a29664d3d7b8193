"""Generated protobuf code must be exactly what protoc makes from protos/ (never hand-edited).
protoc runs in a child process: grpc_tools' C++ extension, loaded into a test process that already
holds other native libraries (grpc, torch, ...), once crashed the whole run on import."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
GEN = ROOT / "services" / "common" / "gen"


def _generate(out: pathlib.Path) -> list[pathlib.Path]:
    code = ("import pathlib, runpy, sys; gen = runpy.run_path(sys.argv[1])['generate']; "
            "print('\\n'.join(str(p) for p in gen(pathlib.Path(sys.argv[2]))))")
    run = subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts" / "gen_protos.py"), str(out)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    return [pathlib.Path(line) for line in run.stdout.splitlines() if line.strip()]


def test_generated_code_matches_the_proto_sources(tmp_path):
    fresh = _generate(tmp_path / "gen")
    assert fresh, "protoc generated nothing"
    for path in fresh:
        rel = path.relative_to(tmp_path / "gen")
        committed = GEN / rel
        assert committed.exists(), f"{rel} is missing: run `make setup`"
        assert committed.read_bytes() == path.read_bytes(), f"{rel} is stale or edited by hand: run `make setup`"
    stale = {p.relative_to(GEN) for p in GEN.rglob("*_pb2*.py")} - {p.relative_to(tmp_path / "gen") for p in fresh}
    assert not stale, f"generated files without a .proto: {sorted(map(str, stale))}"


def test_every_contract_of_the_design_exists():
    names = {p.stem for p in (ROOT / "protos" / "meshllm" / "v1").glob("*.proto")}
    assert {"common", "generation", "tokenizer", "engine", "step", "health"} <= names
