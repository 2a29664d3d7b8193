"""The `meshllm` command line: legacy vLLM flags fail clearly, bad input is refused."""
import subprocess
import sys

import pytest

from services.cli.legacy_flags import LEGACY_FLAGS, check_legacy_flags


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "services.cli.main", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("flag", ["--use-v2-block-manager", "--swap-space=4", "--worker-use-ray"])
def test_removed_vllm_flags_fail_with_their_replacement(flag):
    r = run_cli("serve", "/nonexistent", flag)
    assert r.returncode == 2
    name = flag.split("=")[0]
    assert f"{name} no longer exists" in r.stderr
    assert LEGACY_FLAGS[name] in r.stderr


def test_current_flags_are_not_mistaken_for_legacy_ones():
    assert check_legacy_flags(["serve", "m", "--max-num-seqs", "8", "--max-model-len=512"]) is None


def test_serve_refuses_a_directory_without_a_model(tmp_path):
    r = run_cli("serve", str(tmp_path))
    assert r.returncode == 2 and "not a model directory" in r.stderr


def test_unknown_command_is_an_error():
    r = run_cli("frobnicate")
    assert r.returncode == 2 and "unknown command" in r.stderr
