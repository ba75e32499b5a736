"""Product tools as subcommands."""

from __future__ import annotations


def register(sub) -> None:
    pass
