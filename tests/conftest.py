import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (the GPU tier runs with `pytest -m gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Tests never touch the user's cache: one fresh cache for the whole session."""
    root = os.environ.get("FLASHGEN_TEST_CACHE") or str(tmp_path_factory.mktemp("flashgen-cache"))
    os.chmod(root, 0o700)
    previous = os.environ.get("FLASHGEN_CACHE_DIR")
    os.environ["FLASHGEN_CACHE_DIR"] = root
    yield root
    if previous is None:
        os.environ.pop("FLASHGEN_CACHE_DIR", None)
    else:
        os.environ["FLASHGEN_CACHE_DIR"] = previous
