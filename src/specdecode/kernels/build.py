"""Compiling the kernel with the system's C compiler, once per source, compiler and machine kind.

The library is built into $SPECDECODE_CACHE/kernels/<key>/ where the key hashes the sources, the
compiler's version, the flags and the units built, so an edited source, another compiler or
another kind of CPU builds anew and a stale build is never loaded. Each instruction-set file is
compiled with its own flags (never -march=native; which path runs is decided at run time by cpuid
plus a self-check); a file the compiler cannot build leaves that path out, and so does a file for
features this CPU lacks (AVX-512, AVX-VNNI and AMX on an AVX2-only CPU: code that could never
run here). The library links torch's own OpenMP runtime when torch ships one, so the kernel's
threads are torch's pool. A build's sha256 is written beside it and checked before loading: a
corrupt file is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..paths import cache_dir

CSRC = Path(__file__).parent / "csrc"
BASE_FLAGS = ["-O3", "-fPIC", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno", "-fno-strict-aliasing"]
# the attention units' elementwise loops (the exponential's clamp, SwiGLU's select) are
# vectorized only where a comparison may not trap: the same IEEE operations lane by lane, so the
# same bits, and SwiGLU over the 1.5B's 8960 values 48 -> 9 us (benchmarks/NOTES.md, issue 53)
NO_TRAPS = "-fno-trapping-math"
# source -> extra flags; the core and the reference are required, the ISA files optional
UNITS = {
    "sdk_core.c": ["-fopenmp"],
    "sdk_ref.c": [],
    "sdk_attn.c": ["-fopenmp", NO_TRAPS],
    "sdk_forward.c": [],
    "sdk_attn_avx2.c": ["-fopenmp", "-mavx2", NO_TRAPS],
    "sdk_attn_avx512.c": ["-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", NO_TRAPS],
    "sdk_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "sdk_avxvnni.c": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
    "sdk_avx512vnni.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"],
    # the AMX path (its few-row calls take sdk_avx512vnni.c's code, hence the same flags and more)
    "sdk_amx.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c", "-mamx-tile",
                  "-mamx-int8"],
}
REQUIRED = ("sdk_core.c", "sdk_ref.c", "sdk_attn.c", "sdk_forward.c")
# the CPU flag (as /proc/cpuinfo names it) each instruction-set option needs
CPU_FLAG = {
    "-mavx2": "avx2", "-mfma": "fma", "-mf16c": "f16c", "-mavxvnni": "avx_vnni", "-mavx512f": "avx512f",
    "-mavx512bw": "avx512bw", "-mavx512vl": "avx512vl", "-mavx512vnni": "avx512_vnni",
    "-mamx-tile": "amx_tile", "-mamx-int8": "amx_int8",
}  # fmt: skip
LIB = "libspecdecode_kernel.so"


class BuildError(RuntimeError):
    """The kernel could not be built here (no compiler, a failed compile or link)."""


def compiler() -> str | None:
    """$CC, else cc or gcc on PATH; None when there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name.split()[0]):
            return name
    return None


def _torch_gomp() -> Path | None:
    """torch's bundled OpenMP runtime (libgomp.so.1 in torch/lib), to share its thread pool."""
    try:
        import torch
    except ImportError:
        return None
    lib = Path(torch.__file__).parent / "lib"
    return lib if (lib / "libgomp.so.1").exists() else None


def cpu_flags() -> set[str] | None:
    """This CPU's feature flags as the OS reports them (Linux), or None where it does not say."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def units_for_this_cpu(flags: set[str] | None = None) -> tuple[dict[str, list[str]], list[str]]:
    """(the units to compile, those left out): an instruction-set file whose options need a
    feature this CPU lacks is left out, as its code could never run here (AVX-512 and AMX on an
    AVX2-only CPU: 9 of the build's 16 s of compiling). Where the OS does not report the
    features, every unit."""
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return dict(UNITS), []
    keep, left = {}, []
    for src, opts in UNITS.items():
        if src in REQUIRED or {CPU_FLAG[o] for o in opts if o in CPU_FLAG} <= flags:
            keep[src] = opts
        else:
            left.append(src)
    return keep, left


def build_key(cc: str) -> str:
    """A hash of the sources, the compiler's version, the flags, the units this CPU builds and the
    OpenMP runtime linked."""
    h = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        if f.suffix in (".c", ".h"):
            h.update(f.name.encode() + f.read_bytes())
    try:
        run = subprocess.run([cc.split()[0], "--version"], capture_output=True, text=True, timeout=30)
        version = run.stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    h.update(version.encode())
    h.update(json.dumps([BASE_FLAGS, units_for_this_cpu()[0], str(_torch_gomp())]).encode())
    return h.hexdigest()[:16]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def built_library(verbose: bool = False) -> Path:
    """The compiled library's path, building it first when there is no sound build for these
    sources and this compiler. Raises BuildError with one line when it cannot be built."""
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler found (set CC or install gcc)")
    out = cache_dir() / "kernels" / build_key(cc)
    lib, manifest = out / LIB, out / "manifest.json"
    if lib.exists() and manifest.exists():
        try:
            if json.loads(manifest.read_text()).get("sha256") == _sha256(lib):
                return lib
        except (json.JSONDecodeError, OSError):
            pass
        print(f"specdecode: the kernel build in {out} is corrupt; rebuilding it", file=sys.stderr)
    return _build(cc, out, verbose)


def _build(cc: str, out: Path, verbose: bool) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    missing = []
    chosen, not_here = units_for_this_cpu()
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        objs = []
        units = [(src, Path(tmp) / (src[:-2] + ".o"), flags) for src, flags in chosen.items()]
        for (src, obj, _), r in zip(units, compile_units(cc, BASE_FLAGS, units)):
            if r.returncode != 0:
                if src in REQUIRED:
                    raise BuildError(f"{cc} failed on {src}: {_first_error(r.stderr)}")
                missing.append(src[4:-2])
                continue
            objs.append(str(obj))
        gomp = _torch_gomp()
        omp = [f"-L{gomp}", "-lgomp", f"-Wl,-rpath,{gomp}"] if gomp else ["-fopenmp"]
        tmp_lib = Path(tmp) / LIB
        cmd = [*cc.split(), "-shared", *objs, "-o", str(tmp_lib), *omp, "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"{cc} failed to link the kernel: {_first_error(r.stderr)}")
        os.replace(tmp_lib, out / LIB)
    (out / "manifest.json").write_text(
        json.dumps(
            {
                "sha256": _sha256(out / LIB),
                "compiler": cc,
                "paths_not_built": missing,
                "not_for_this_cpu": [src[4:-2] for src in not_here],
            },
            indent=1,
        )
    )
    if verbose or missing:
        left = f" (the compiler cannot build: {', '.join(missing)})" if missing else ""
        print(f"specdecode: built the quantized kernel into {out}{left}", file=sys.stderr)
    return out / LIB


def compile_units(cc: str, base: list[str], units: list[tuple[str, Path, list[str]]]) -> list:
    """Each (source, object, flags) compiled at once, one compiler per core (ten units of 3-9 s
    each: a 2-core machine builds in about half the time of one after another); the
    CompletedProcess of each, in order."""
    def one(unit):
        src, obj, flags = unit
        cmd = [*cc.split(), *base, *flags, "-c", str(CSRC / src), "-o", str(obj)]
        return subprocess.run(cmd, capture_output=True, text=True)

    with ThreadPoolExecutor(max(1, min(len(units), os.cpu_count() or 1))) as pool:
        return list(pool.map(one, units))


def _first_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if "error" in ln] or stderr.splitlines() or ["(no message)"]
    return lines[0].strip()
