"""A progress bar on stderr for long loops (rich's, when rich is installed and stderr is a terminal)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def bar(items: Iterable[T], description: str, enabled: bool = True, total: int | None = None) -> Iterator[T]:
    """Iterate over items, drawing rich's progress bar while it runs (nothing when disabled,
    when stderr is not a terminal, or without rich)."""
    if enabled and sys.stderr.isatty():
        try:
            from rich.console import Console
            from rich.progress import track
        except ImportError:
            pass
        else:
            yield from track(items, description, total=total, console=Console(stderr=True), transient=True)
            return
    yield from items
