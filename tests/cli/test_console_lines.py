"""Messages the CLI prints stay on one line when written to a pipe or a log (rich wraps at 80 columns there by
default), so a refusal can be grepped and a printed command pasted."""
from click.testing import CliRunner

from flamia_gen.cli import main
from flamia_gen.console import make_console


def test_a_long_refusal_is_one_line(tmp_path):
    d = tmp_path / ("a-folder-with-a-long-name-" * 6)  # > 200 columns with the message around it
    d.mkdir()
    p = d / "sm90-x.json"
    p.write_text('{"_metadata": {"format": 1')
    res = CliRunner().invoke(main, ["table", "check", str(p)])
    assert res.exit_code == 1
    line = next(ln for ln in res.output.splitlines() if "refused" in ln)
    assert str(p) in line and "corrupt JSON" in line and line.endswith("ignored"), res.output


def test_tables_in_a_log_are_laid_out_wide():
    c = make_console()  # pytest captures stdout: not a terminal
    assert not c.is_terminal and c.width == 200
