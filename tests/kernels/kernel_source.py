"""Pieces of a rendered kernel source, for the template tests that check what one method does (imported by them:
pytest puts this folder on sys.path)."""

from __future__ import annotations

import re


def method_source(src: str, name: str) -> str:
    """The text of method `name` of the rendered kernel class: from its `def` to the next method, decorated or not,
    or to the end of the class (the next top-level statement)."""
    start = src.index(f"    def {name}(")
    nxt = re.compile(r"\n    (?:@cute\.jit|def )|\n\S").search(src, start + 1)
    return src[start:nxt.start() if nxt else len(src)]


def one_tile(src: str) -> str:
    """one_tile: a query tile against the unit's key tile (both copies' source: interior and masked)."""
    return method_source(src, "one_tile")
