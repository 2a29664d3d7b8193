import pytest

from tests.integration.meshproc import alive, start_mesh


@pytest.fixture(scope="session")
def mesh(smollm2_dir, minilm_dir):
    """The whole mesh serving the real SmolLM2 weights (and MiniLM embeddings), shared by the
    integration tests."""
    m = start_mesh(str(smollm2_dir), "--max-model-len", "2048", "--max-num-seqs", "32",
                   "--embedding-model", str(minilm_dir))
    pids = m.service_pids()
    yield m
    rc = m.stop()
    assert rc == 0, f"the launcher exited with {rc} on SIGTERM"
    assert not [p for p in pids if alive(p)], "services left running after the launcher stopped"
