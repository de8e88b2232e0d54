"""A GGUF's own quantized blocks as our weight-only kernels' formats (models/quant.py), read
straight from the file instead of through its bf16 dequantization.

Q4_K (llama.cpp's 4-bit k-quant, the bulk of a Q4_K_M file): super-blocks of 256 weights, a
fp16 scale d and minimum-scale dmin, and for each of its eight sub-blocks of 32 a 6-bit scale
sc and 6-bit minimum m; a weight is d * sc * q - dmin * m with q in 0..15. That is exactly our
int4 group-32 format, w = (q - 8) * s + z, with s = d * sc and z = 8 * s - dmin * m: the 4-bit
values are kept bit for bit and only s and z are rounded, to the bf16 the kernel multiplies by
(2^-8 relative each; `compare()` reports the largest absolute difference to the file).

Other types have no torch kernel of their own: Q6_K, Q5_0, Q8_0 and float matrices become int8
with one scale per output row, quantized from their dequantized values (int8 keeps more than
the 5-6 bits these carry, up to the row's range). `q8_0` requantizes everything that way.

`kq` (specdecode's kernel, kernels/) keeps every Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0 tensor's values
bit for bit: the very weights llama.cpp reads. Any other type (F16, Q4_1, ...) is dequantized and
rounded to Q8_0, said once per file on stderr. `kq4` (a draft's format) keeps Q4_K and Q4_0 and
rounds every other matrix to Q4_0, Q6_K included: a draft's bytes are its speed, and its weights
never change the output (benchmarks/NOTES.md, issue 53: the 0.5B's Q6_K down projections as Q4_0
took 5% off its drafting time a round, tau -1%). `kq3` is kq4 with the MLP's gate and up
projections rounded to specdecode's 3-bit Q3_0 (models/quant.py part_kind).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from ..errors import SpecDecodeError
from ..kernels.blocks import BlockWeight, quantize_q3_0, quantize_q4_0, quantize_q8_0
from ..kernels.store import cached, source_tag
from .gguf_import import _field, _require_gguf, hf_name, unpermute_rope
from .quant import KERNEL_KINDS, QWeight, _bf16

# what a fmt keeps as is: GGUF type name -> our format
KEEPS = {
    "q4_k": ("Q4_K",),
    "q8_0": (),
    "kq": ("Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0"),
    "kq4": ("Q4_K", "Q4_0"),
    "kq3": ("Q4_K", "Q4_0"),  # and the MLP's gate and up rounded to Q3_0 (models/quant.py part_kind)
}
FALLBACK = "int8"  # every other matrix (kq: Q8_0)


def q4_k_to_int4(blocks: np.ndarray, rows: int, cols: int) -> QWeight:
    """Q4_K blocks (the raw [rows, cols / 256 * 144] bytes) -> an int4 group-32 QWeight with the
    same 4-bit values."""
    gguf = _require_gguf()
    nb = rows * cols // 256
    b = np.ascontiguousarray(blocks).reshape(nb, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [nb, 1]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16].copy())  # [nb, 8] each
    qs = b[:, 16:].reshape(nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(rows, cols)  # sub-block 2j: low nibbles of chunk j, 2j + 1: high
    s = torch.from_numpy(d * sc.astype(np.float32)).reshape(rows, cols // 32)
    mins = torch.from_numpy(dmin * m.astype(np.float32)).reshape(rows, cols // 32)
    s = _bf16(s)
    z = _bf16(8 * s - mins)
    return QWeight(4, torch.from_numpy(np.ascontiguousarray(q)), s, z, 32)


class GGUFQWeights(Mapping):
    """Our weight names -> QWeight, each read from the (memory-mapped) file when asked, so a
    model's quantized matrices are never all unpacked at once."""

    def __init__(self, path: str | Path, fmt: str) -> None:
        if fmt not in KEEPS:
            raise SpecDecodeError(f"unknown GGUF format {fmt!r}; choose one of {', '.join(KEEPS)}")
        self.path, self.fmt = Path(path), fmt
        index = gguf_index(path)
        self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.heads = {"q_proj": index["head_count"], "k_proj": index["head_count_kv"]}
        self.permuted = index["arch"] == "llama"  # llama.cpp interleaved llama's q/k rows (gguf_import.py)
        self.rounded: set[str] = set()
        self.tensors = {}
        for t in index["tensors"]:
            name = hf_name(t["name"])
            if name is not None and name.endswith(".weight") and len(t["shape"]) == 2 and "norm" not in name:
                self.tensors[name] = _Tensor(self.data, t)

    def release(self) -> None:
        """Let the OS drop the file's pages this process read while the blocks were packed (the
        packed copies hold what the kernels read; the file stays mapped for later reads, such as
        a draft vocabulary's head rows). Without it they count in the resident set: the 1.5B's
        kq load grew RSS by 2.1 GB for 1.0 GB of weights."""
        import mmap

        mapped = getattr(self.data, "_mmap", None)
        if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            try:
                mapped.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):
                pass

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name) -> bool:  # Mapping's own would unpack the matrix to answer
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __getitem__(self, name: str) -> QWeight | BlockWeight:
        gguf = _require_gguf()
        t = self.tensors[name]
        cols, rows = (int(x) for x in t.shape)  # GGUF lists dimensions innermost first
        kind = t.tensor_type.name
        if self.fmt in KERNEL_KINDS:
            return self._unpermute(name, self._blocks(name, t, kind, rows, cols))
        if kind in KEEPS[self.fmt] and kind == "Q4_K":
            q = q4_k_to_int4(t.data, rows, cols)
        else:
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(rows, cols)
            q = QWeight.from_float(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)), FALLBACK)
        return self._unpermute(name, q)

    def _blocks(self, name: str, t, kind: str, rows: int, cols: int) -> BlockWeight:
        """A tensor's blocks for the kernel: as stored, anything else rounded to Q8_0 (kq4: to
        Q4_0; kq3: its MLP's gate and up to Q3_0, the rest as kq4; said nowhere: a draft's
        weights never change the output)."""
        raw = np.asarray(t.data).reshape(rows, -1)
        if self.fmt == "kq3" and name.split(".")[-2] in ("gate_proj", "up_proj"):
            return self._rounded(t, rows, cols, "q3_0")
        if kind in KEEPS[self.fmt]:
            return BlockWeight(kind.lower(), raw, cols)
        if self.fmt in ("kq4", "kq3"):
            return self._rounded(t, rows, cols, "q4_0")
        if kind not in self.rounded:
            self.rounded.add(kind)
            print(
                f"specdecode: {self.path.name}: its {kind} matrices have no kernel of their own; "
                "rounded to Q8_0 (8 bits per 32)",
                file=sys.stderr,
            )
        return self._rounded(t, rows, cols, "q8_0")

    @staticmethod
    def _rounded(t, rows: int, cols: int, kind: str) -> BlockWeight:
        """A tensor dequantized by the gguf library and rounded to `kind` blocks: kept in the cache
        by the tensor's bytes (kernels/store.py), since the library's numpy dequantization is
        most of a kq4 draft's load (~12 s of the 0.5B's on the AMX Xeon)."""
        gguf = _require_gguf()

        def make() -> np.ndarray:
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(rows, cols)
            quantize = {"q4_0": quantize_q4_0, "q3_0": quantize_q3_0}.get(kind, quantize_q8_0)
            return quantize(np.asarray(w, dtype=np.float32)).raw

        tag = f"rounded:{t.tensor_type.name}->{kind}:{rows}x{cols}:gguf {_gguf_version()}:{_rounding_tag()}"
        return BlockWeight(kind, cached(tag, [np.asarray(t.data)], make), cols)

    def dequantized(self, name: str) -> torch.Tensor:
        """The file's own dequantization of a matrix (float32 [rows, cols], as our runtime lays it out)."""
        gguf = _require_gguf()
        t = self.tensors[name]
        cols, rows = (int(x) for x in t.shape)
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(rows, cols)
        w = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
        proj = name.split(".")[-2]
        if self.permuted and proj in self.heads:
            w = w[self._order(rows, self.heads[proj])]
        return w

    def type_of(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def _order(self, rows: int, n_head: int) -> torch.Tensor:
        return torch.from_numpy(unpermute_rope(np.arange(rows)[:, None], n_head)[:, 0].copy())

    def _unpermute(self, name: str, q: QWeight | BlockWeight) -> QWeight | BlockWeight:
        proj = name.split(".")[-2]
        if not self.permuted or proj not in self.heads:
            return q
        if isinstance(q, BlockWeight):
            return q.rows(self._order(q.raw.shape[0], self.heads[proj]).numpy())
        order = self._order(q.q.shape[0], self.heads[proj])
        zeros = None if q.zeros is None else q.zeros[order]
        return QWeight(q.bits, q.q[order], q.scales[order], zeros, q.group, q.in_features)

    def compare(self) -> dict[str, dict]:
        """Per GGUF type: how many matrices, our format, and the largest absolute difference
        between the weights our kernels multiply by and the file's own dequantization."""
        out: dict[str, dict] = {}
        for name in self.tensors:
            kind = self.type_of(name)
            q = self[name]
            ours = torch.as_tensor(q.dequantize())
            diff = float((ours - self.dequantized(name)).abs().max())
            row = out.setdefault(kind, {"matrices": 0, "ours": q.kind, "max_abs_diff": 0.0})
            row["matrices"] += 1
            row["max_abs_diff"] = max(row["max_abs_diff"], diff)
        return out


def read_qweights(path: str | Path, fmt: str) -> tuple[GGUFQWeights, str]:
    """(the file's matrices as QWeights (kq: BlockWeights) by our names, the format the rest are
    quantized to)."""
    return GGUFQWeights(path, fmt), (fmt if fmt in KERNEL_KINDS else FALLBACK)


@functools.lru_cache(maxsize=8)
def narrow_kind(path: str | Path) -> str:
    """The kq blocks a file's matrices of widths that are no multiple of 256 load as: q5_0 when
    most of them are Q5_0 in the file (llama.cpp's k-quant mixes), else q8_0 (for the autotuner,
    which times random blocks of the kinds a load gives), from the file's cached index."""
    kinds: dict[str, int] = {}
    for t in gguf_index(path)["tensors"]:
        if len(t["shape"]) == 2 and int(t["shape"][0]) % 256:
            kinds[t["type"]] = kinds.get(t["type"], 0) + 1
    return "q5_0" if kinds and max(kinds, key=kinds.get) == "Q5_0" else "q8_0"


_INDEX_VERSION = 1


def gguf_index(path: str | Path) -> dict:
    """What the runtime reads of a GGUF besides its tensors' bytes: the architecture, the head
    counts, and per tensor its name, type, shape (GGUF order, innermost first), offset and size.
    The gguf library parses every field of the file, its vocabulary included (~11 s for a Qwen2.5
    file on the AMX Xeon), so the index is kept in the cache by the file's path, size and
    modification time."""
    import json

    from ..paths import cache_dir

    p = Path(path).resolve()
    st = p.stat()
    key = f"{_INDEX_VERSION}:{p}:{st.st_size}:{st.st_mtime_ns}"
    memo = cache_dir() / "gguf-files" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    try:
        known = json.loads(memo.read_text())
        if known.get("key") == key:
            return known
    except (OSError, ValueError):
        pass
    gguf = _require_gguf()
    try:
        reader = gguf.GGUFReader(str(p))
    except (ValueError, OSError) as e:
        raise SpecDecodeError(f"{p}: not a readable GGUF file ({e})") from None
    arch = _field(reader, "general.architecture")
    index = {
        "key": key,
        "arch": arch,
        "head_count": int(_field(reader, f"{arch}.attention.head_count")),
        "head_count_kv": int(_field(reader, f"{arch}.attention.head_count_kv")),
        "tensors": [
            {
                "name": t.name,
                "type": t.tensor_type.name,
                "shape": [int(x) for x in t.shape],
                "offset": int(t.data_offset),
                "nbytes": int(t.n_bytes),
            }
            for t in reader.tensors
        ],
    }
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index))
        os.replace(tmp, memo)
    except OSError:
        pass  # parsed again next time
    return index


class _Tensor:
    """One tensor of a GGUF index over the file's memory map, as the gguf library's ReaderTensor
    gives it: `data` is [rows, bytes per row] uint8 for block types, the values for float ones."""

    FLOATS = {"F16": np.float16, "F32": np.float32, "F64": np.float64}

    def __init__(self, mapped: np.ndarray, info: dict) -> None:
        gguf = _require_gguf()
        self.name, self.shape = info["name"], info["shape"]
        self.tensor_type = gguf.GGMLQuantizationType[info["type"]]
        view = mapped[info["offset"] : info["offset"] + info["nbytes"]]
        dims = tuple(reversed(self.shape))
        if info["type"] in self.FLOATS:
            self.data = view.view(self.FLOATS[info["type"]]).reshape(dims)
        else:
            self.data = view.reshape(gguf.quant_shape_to_byte_shape(dims, self.tensor_type))


@functools.cache
def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


@functools.cache
def _rounding_tag() -> str:
    from ..kernels import blocks

    return source_tag(blocks.__file__)
