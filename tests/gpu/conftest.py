"""GPU-only tests (run on a CUDA machine, never in CI: `make test` runs tests/unit and
tests/integration only). Everything here is skipped without a CUDA device."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        item.add_marker(skip)
