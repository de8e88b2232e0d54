"""Where specdecode keeps what it makes once per machine (converted models, the compiled kernel)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$SPECDECODE_CACHE, else $XDG_CACHE_HOME/specdecode, else ~/.cache/specdecode."""
    env = os.environ.get("SPECDECODE_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdecode"
