"""Arrays made once from a model's weights and kept in the cache, so a second load reads them
instead of making them again: the kernel's packed tiles (`BlockWeight.tiles`) and a draft's
blocks rounded to Q4_0 (`kq4`). Made in numpy, the 1.5B + 0.5B pair's took ~22 s of a 43.7 s
start-up on the AMX Xeon (the GGUF's parsed index, kept by models/gguf_quant.py, ~22 s more;
benchmarks/NOTES.md, issue 53, twelfth session); read back they take about a second.

An entry is keyed by what it is made from: a tag (what is made, the version of the code that
makes it) and the sha256 of every source array's bytes, so a changed file, tensor, selection of
rows or layout gets a new entry and never a stale one. Its bytes are checked against the sha256
recorded when it was written before they are used; a damaged entry is made again, with one line.
The sha256 is taken in fixed pieces on every core (`digest`). Arrays under MIN_BYTES are made
every time (hashing and a file cost more than the making). SPECDECODE_WEIGHT_CACHE=0 turns the
store off. Entries live in $SPECDECODE_CACHE/weights/
(paths.cache_dir); deleting that folder is always safe, and entries unused for KEEP_DAYS go when a
process writes a new one (a read marks an entry used)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..paths import cache_dir

MIN_BYTES = 64 << 10
ANNOUNCE_BYTES = 4 << 20  # the first entry made from this much says so, once a process
KEEP_DAYS = 30  # entries unused this long go when a process writes a new one
_warned: set[str] = set()


def enabled() -> bool:
    return os.environ.get("SPECDECODE_WEIGHT_CACHE", "1").strip() not in ("0", "off", "no", "false")


def source_tag(*paths: str | Path) -> str:
    """A short hash of source files' text: a tag that changes whenever the code that makes an
    entry does."""
    h = hashlib.sha256()
    for p in paths:
        h.update(Path(p).read_bytes())
    return h.hexdigest()[:16]


CHUNK = 2 << 20


def digest(a: np.ndarray) -> str:
    """sha256 of an array's bytes, taken in CHUNK pieces on every core (hashlib lets go of the
    GIL) and joined: the sha256 of the pieces' sha256s (of the bytes themselves when they fit in
    one piece). The pieces' size is fixed, so the digest is the same on any machine."""
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    if flat.nbytes <= CHUNK:
        return hashlib.sha256(flat).hexdigest()
    pieces = [flat[i : i + CHUNK] for i in range(0, flat.nbytes, CHUNK)]
    parts = _pool().map(lambda p: hashlib.sha256(p).digest(), pieces)
    return hashlib.sha256(b"".join(parts)).hexdigest()


@functools.cache
def _pool():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="specdecode-digest")


def key_of(tag: str, sources: Sequence[np.ndarray]) -> str:
    """sha256 of the tag, then each source's dtype, shape and digest."""
    h = hashlib.sha256(tag.encode())
    for s in sources:
        h.update(f"|{s.dtype.str}{tuple(s.shape)}|{digest(s)}".encode())
    return h.hexdigest()


def cached(tag: str, sources: Sequence[np.ndarray], make: Callable[[], np.ndarray]) -> np.ndarray:
    """make(), or the array it made before from sources with the same bytes under this tag."""
    if not enabled() or sum(s.nbytes for s in sources) < MIN_BYTES:
        return make()
    key = key_of(tag, sources)
    folder = cache_dir() / "weights" / key[:2]
    meta, data = folder / f"{key}.json", folder / f"{key}.bin"
    if meta.exists():
        got = _read(meta, data)
        if got is not None:
            with contextlib.suppress(OSError):
                os.utime(meta)  # used now: pruning keeps it (_prune)
            return got
    if not _warned.intersection({"made"}) and sum(s.nbytes for s in sources) >= ANNOUNCE_BYTES:
        _warned.add("made")
        print(
            f"specdecode: packing weights for the kernel once (later loads read them from "
            f"{cache_dir() / 'weights'})",
            file=sys.stderr,
        )
    arr = np.ascontiguousarray(make())
    _write(folder, meta, data, arr, tag)
    return arr


def _read(meta: Path, data: Path) -> np.ndarray | None:
    """The entry's array, or None (one line) when it is unreadable or its bytes are not the ones
    its sha256 names."""
    try:
        info = json.loads(meta.read_text())
        arr = np.empty(tuple(info["shape"]), np.dtype(info["dtype"]))
        flat = arr.reshape(-1).view(np.uint8)
        with open(data, "rb") as f:
            n = f.readinto(memoryview(flat))
            extra = f.read(1)
        if n != flat.nbytes or extra:
            raise ValueError(f"{n} bytes{' and more' if extra else ''}, not {flat.nbytes}")
        if digest(flat) != info["sha256"]:
            raise ValueError("its sha256 differs from the one recorded")
        return arr
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"specdecode: cached weights {data} are damaged ({e}); making them again", file=sys.stderr)
        return None


def _write(folder: Path, meta: Path, data: Path, arr: np.ndarray, tag: str) -> None:
    """Keep arr under its key (data first, its record last, each renamed into place whole), or
    say once why it cannot be kept and go on without."""
    info = {
        "tag": tag,
        "dtype": arr.dtype.str,
        "shape": list(arr.shape),
        "sha256": digest(arr),
    }
    tmp = f".{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(data.with_name(data.name + tmp), "wb") as f:
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))
        os.replace(data.with_name(data.name + tmp), data)
        meta.with_name(meta.name + tmp).write_text(json.dumps(info))
        os.replace(meta.with_name(meta.name + tmp), meta)
        if "pruned" not in _warned:
            _warned.add("pruned")
            _prune(cache_dir() / "weights")
    except OSError as e:
        for p in (data.with_name(data.name + tmp), meta.with_name(meta.name + tmp)):
            with contextlib.suppress(OSError):
                p.unlink(missing_ok=True)
        where = str(cache_dir() / "weights")
        if where not in _warned:
            _warned.add(where)
            print(
                f"specdecode: cannot keep packed weights in {where} ({e.strerror or e}); they are "
                "made again at each load (set SPECDECODE_CACHE to a writable folder with room)",
                file=sys.stderr,
            )


def _prune(root: Path) -> None:
    """Remove the entries no load has read or written for KEEP_DAYS (made by older packing code, or
    for models no longer used), once a process, when it writes one; one line says what went."""
    import time

    cutoff, gone, freed = time.time() - KEEP_DAYS * 86400, 0, 0
    for meta in root.glob("*/*.json"):
        with contextlib.suppress(OSError):
            if meta.stat().st_mtime < cutoff:
                data = meta.with_suffix(".bin")
                freed += data.stat().st_size if data.exists() else 0
                meta.unlink()
                data.unlink(missing_ok=True)
                gone += 1
    if gone:
        print(
            f"specdecode: removed {gone} packed-weight entries unused for {KEEP_DAYS} days from {root} "
            f"({freed / 1e9:.2f} GB)",
            file=sys.stderr,
        )
