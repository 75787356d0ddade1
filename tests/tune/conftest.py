import pytest


@pytest.fixture
def storage_url(tmp_path):
    return f"sqlite:///{tmp_path / 'tune.db'}"
