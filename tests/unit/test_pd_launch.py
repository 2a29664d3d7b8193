"""What the launcher asks the supervisor to run for prefill/decode disaggregation (docs/pd.md;
the spec, no process started): roles on the engines, the direct hand-off's flags on both kinds of
worker (or none with --kv-handoff kvstore), tensor-parallel engines of one size, and combinations it
refuses before anything starts."""
from __future__ import annotations

import pytest

from services.cli.main import _mesh_config, _serve_parser
from tests.unit.test_kvstore_launch import _args_of, _flag, _mesh, cleanup  # noqa: F401 - fixture


def test_prefill_and_decode_engines_get_their_roles_and_the_direct_flags(smollm2_dir, cleanup):  # noqa: F811
    mesh = _mesh(smollm2_dir, "--prefill-replicas", "2", "--decode-replicas", "1", "--kv-lease-s", "7")
    cleanup(mesh)
    spec = mesh._replicas()
    engines = {r.id: r for r in spec if r.id.startswith("engine-")}
    assert [engines[f"engine-{i}"].role for i in range(3)] == ["prefill", "prefill", "decode"]
    schedulers, workers = _args_of(spec, "scheduler"), _args_of(spec, "worker")
    assert sorted(_flag(a, "--kv-role") for a in schedulers) == ["decode", "prefill", "prefill"]
    assert all(float(_flag(a, "--kv-lease-s")) == 7.0 and _flag(a, "--kv-load-failure-policy") == "recompute"
               for a in schedulers)
    assert all("--kv-export" in a and _flag(a, "--kv-direct-transport") == "mmap" for a in workers)


def test_the_kvstore_hand_off_exports_nothing(smollm2_dir, cleanup):  # noqa: F811
    mesh = _mesh(smollm2_dir, "--prefill-replicas", "1", "--decode-replicas", "1", "--kv-handoff", "kvstore")
    cleanup(mesh)
    spec = mesh._replicas()
    assert not any("--kv-export" in a for a in _args_of(spec, "worker"))
    assert all(_flag(a, "--kvstore-addr") == mesh.kvstore_address for a in _args_of(spec, "worker"))


def test_tensor_parallel_engines_hand_off_with_one_size_on_both_roles(smollm2_dir, cleanup):  # noqa: F811
    """One --tensor-parallel-size for every engine: prefill rank r pairs with decode rank r (a
    mismatch between separately started workers is refused at hand-off, kv_export.check_tp)."""
    mesh = _mesh(smollm2_dir, "--prefill-replicas", "1", "--decode-replicas", "1", "--tensor-parallel-size", "2")
    cleanup(mesh)
    workers = _args_of(mesh._replicas(), "worker")
    assert len(workers) == 2
    assert all(_flag(a, "--tensor-parallel-size") == "2" and "--kv-export" in a for a in workers)


def test_colocated_engines_have_no_role(smollm2_dir, cleanup):  # noqa: F811
    mesh = _mesh(smollm2_dir, "--data-parallel-size", "2")
    cleanup(mesh)
    spec = mesh._replicas()
    assert all(not r.role for r in spec)
    assert not any("--kv-role" in a for a in _args_of(spec, "scheduler"))


@pytest.mark.parametrize("flags,message", [
    (("--prefill-replicas", "1"), "go together"),
    (("--prefill-replicas", "1", "--decode-replicas", "1", "--data-parallel-size", "2"), "alternatives"),
    (("--prefill-replicas", "1", "--decode-replicas", "1", "--kv-handoff", "kvstore", "--no-kv-tier"), "kvstore"),
    (("--prefill-replicas", "1", "--decode-replicas", "1", "--kv-lease-s", "0"), "kv-lease-s"),
])
def test_bad_pd_flags_fail_before_anything_starts(smollm2_dir, flags, message):
    a = _serve_parser("meshllm serve", with_model=True).parse_args([str(smollm2_dir), "--simulate-worker", *flags])
    with pytest.raises(ValueError, match=message):
        _mesh_config(a, str(smollm2_dir), "m")
