import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # Never touch the user's build cache from tests.
    if "FLAMIA_GEN_CACHE" not in os.environ or os.environ.get("FLAMIA_GEN_TEST_SHARED_CACHE") != "1":
        monkeypatch.setenv("FLAMIA_GEN_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)
