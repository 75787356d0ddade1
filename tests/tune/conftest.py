import click
import pytest
from click.testing import CliRunner


@pytest.fixture
def storage_url(tmp_path):
    return f"sqlite:///{tmp_path / 'tune.db'}"


@pytest.fixture
def run(monkeypatch, tmp_path):
    """The tuning CLI (tune, freeze, table) as one click group: run("tune", ...) → click's Result; a wide console, and
    tables written under tmp_path/db."""
    from rich.console import Console

    from flamia_gen.tune import cli as tcli

    monkeypatch.setattr(tcli, "console", Console(width=250))
    monkeypatch.setenv("FLAMIA_GEN_TUNING_DB", str(tmp_path / "db"))

    @click.group()
    def main():
        pass

    for c in (tcli.tune_command, tcli.freeze_command, tcli.table_command):
        main.add_command(c)
    r = CliRunner()
    return lambda *a: r.invoke(main, list(a), catch_exceptions=False)
