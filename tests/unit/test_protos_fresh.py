"""Generated protobuf code must be exactly what protoc makes from protos/ (never hand-edited)."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
GEN = ROOT / "services" / "common" / "gen"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_code_matches_the_proto_sources(tmp_path):
    fresh = _load_generator().generate(tmp_path / "gen")
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
