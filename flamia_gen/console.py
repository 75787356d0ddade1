"""The rich console the command-line tools print to."""
from __future__ import annotations

from rich.console import Console


def make_console() -> Console:
    """A console that never breaks a message over lines (a path, a refusal or a command to copy stays
    on one line, so logs can be grepped and commands pasted) and, writing to a log file or a pipe, lays
    tables out 200 columns wide instead of rich's 80-column default for non-terminals."""
    console = Console(soft_wrap=True)
    if not console.is_terminal:
        console = Console(soft_wrap=True, width=200)
    return console
