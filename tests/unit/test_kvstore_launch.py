"""What the launcher asks the supervisor to run for the KV tier (the spec, no process started):
a kvstore replica by default with the engines told its address, none with --no-kv-tier, and an
external one named by --kvstore-addr; bad tier flags fail before anything starts."""
from __future__ import annotations

import shutil

import pytest

from services.cli.launcher import Mesh
from services.cli.main import _mesh_config, _serve_parser
from services.common import pb


def _mesh(model_dir, *flags: str) -> Mesh:
    a = _serve_parser("meshllm serve", with_model=True).parse_args([str(model_dir), "--simulate-worker", *flags])
    return Mesh(_mesh_config(a, str(model_dir), "m"))


def _args_of(spec, module: str) -> list[list[str]]:
    return [list(p.args) for r in spec for p in r.processes if p.module == module]


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


@pytest.fixture
def cleanup():
    made = []
    yield made.append
    for m in made:
        shutil.rmtree(m._tmp, ignore_errors=True)


def test_the_mesh_runs_a_kvstore_by_default_and_tells_every_engine(smollm2_dir, cleanup):
    mesh = _mesh(smollm2_dir, "--data-parallel-size", "2", "--kv-tier-capacity-gb", "2.5")
    cleanup(mesh)
    spec = mesh._replicas()
    kv = [r for r in spec if r.kind == pb.supervisor.REPLICA_KIND_KVSTORE]
    assert len(kv) == 1 and kv[0].addr == mesh.kvstore_address and kv[0].processes[0].health_service == "kvstore"
    (args,) = _args_of(spec, "kvstore")
    assert _flag(args, "--capacity-gb") == "2.5" and _flag(args, "--port") == str(mesh.kvstore_port)
    engines = _args_of(spec, "scheduler") + _args_of(spec, "worker")
    assert len(engines) == 4 and all(_flag(a, "--kvstore-addr") == mesh.kvstore_address for a in engines)
    assert f"kvstore={mesh.kvstore_address}" in mesh.services_line()


def test_no_kv_tier_runs_none_and_tells_no_engine(smollm2_dir, cleanup):
    mesh = _mesh(smollm2_dir, "--no-kv-tier")
    cleanup(mesh)
    spec = mesh._replicas()
    assert not _args_of(spec, "kvstore") and mesh.kvstore_address == ""
    assert all("--kvstore-addr" not in a for a in _args_of(spec, "scheduler") + _args_of(spec, "worker"))
    assert "kvstore" not in mesh.metrics_ports


def test_an_external_kvstore_is_used_and_none_started(smollm2_dir, cleanup):
    mesh = _mesh(smollm2_dir, "--kvstore-addr", "kv.example:50070")
    cleanup(mesh)
    spec = mesh._replicas()
    assert not _args_of(spec, "kvstore")
    assert all(_flag(a, "--kvstore-addr") == "kv.example:50070" for a in _args_of(spec, "scheduler") + _args_of(spec, "worker"))


@pytest.mark.parametrize("flags,message", [
    (("--kv-tier-capacity-gb", "0"), "--kv-tier-capacity-gb"),
    (("--kv-tier-disk-dir", "/tmp/x"), "--kv-tier-disk-gb"),
    (("--kv-tier-backend", "memcached://h:1"), "--kv-tier-backend"),
    (("--kvstore-addr", "nohostport"), "kvstore-addr"),
])
def test_bad_tier_flags_fail_before_anything_starts(smollm2_dir, flags, message):
    a = _serve_parser("meshllm serve", with_model=True).parse_args([str(smollm2_dir), "--simulate-worker", *flags])
    with pytest.raises(ValueError, match=message):
        _mesh_config(a, str(smollm2_dir), "m")   # MeshConfig refuses them: no process is started
