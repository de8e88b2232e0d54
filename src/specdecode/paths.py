"""Where specdecode keeps what it makes once per machine (converted models, the compiled kernel),
and the machine fact such records are keyed by (the CPU)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cache_dir() -> Path:
    """$SPECDECODE_CACHE, else $XDG_CACHE_HOME/specdecode, else ~/.cache/specdecode."""
    env = os.environ.get("SPECDECODE_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdecode"


def cpu_name() -> str:
    """The CPU's model name and its vector extensions that change which kernels run."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    keep = sorted(f for f in set(flags) if f.startswith(("avx512", "avx2", "amx", "avx_vnni", "fma")))
    return f"{model} [{' '.join(keep)}]"
