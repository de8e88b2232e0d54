"""Roofline arithmetic: how long a forward must take at least, from the bytes it reads and the
operations it does, on a given chip. A lower bound, not a prediction of any real kernel."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import SpecDecodeError
from .formats import FORMATS

# bytes per weight (formats.py's table, scales included) and fp8 for GPU plans
DTYPE_BYTES = {**{n: f.bytes_per_weight for n, f in FORMATS.items()}, "fp8": 1}


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 (fp32 on cpu) operations per second
    bandwidth: float  # memory bytes per second
    source: str

    @property
    def ridge(self) -> float:
        """Operations per byte where a kernel stops being bandwidth-bound."""
        return self.peak_flops / self.bandwidth


# Vendor datasheet figures: dense (no sparsity) bf16 tensor throughput and HBM/GDDR bandwidth.
HARDWARE = {
    "h100-sxm": Hardware(
        "H100 SXM", 989.4e12, 3.35e12, "NVIDIA H100 datasheet: 989 TFLOPS bf16 dense, 3.35 TB/s"
    ),
    "h200": Hardware("H200", 989.4e12, 4.8e12, "NVIDIA H200 datasheet: 989 TFLOPS bf16 dense, 4.8 TB/s"),
    "a100": Hardware("A100 SXM 80GB", 312e12, 2.039e12, "NVIDIA A100 datasheet: 312 TFLOPS bf16, 2.039 TB/s"),
    "rtx-4090": Hardware(
        "RTX 4090", 165.2e12, 1.008e12, "Ada whitepaper: 165 TFLOPS bf16 (fp32 accumulate), 1.008 TB/s"
    ),
}


def measure_cpu(seconds: float = 0.3) -> Hardware:
    """This machine's CPU: copy bandwidth of a 256 MB tensor and fp32 matmul throughput, measured."""
    import torch

    def best(fn, reps: int) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    a = torch.ones(64 * 1024 * 1024)  # 256 MB
    b = torch.empty_like(a)
    t = best(lambda: b.copy_(a), 5)
    bandwidth = 2 * a.numel() * 4 / t  # read + write
    n = 1024
    x, y = torch.randn(n, n), torch.randn(n, n)
    t = best(lambda: torch.mm(x, y), 10)
    flops = 2 * n**3 / t
    return Hardware(
        "cpu (measured)",
        flops,
        bandwidth,
        f"measured here: {torch.get_num_threads()} threads, tensor copy and 1024² fp32 matmul",
    )


def get_hardware(name: str) -> Hardware:
    if name == "cpu":
        return measure_cpu()
    if name not in HARDWARE:
        raise SpecDecodeError(f"unknown hardware {name!r}; choose one of {', '.join([*HARDWARE, 'cpu'])}")
    return HARDWARE[name]


@dataclass(frozen=True)
class ModelSpec:
    """What the roofline needs of a model: parameters, bytes per weight, KV bytes per token."""

    name: str
    params: float  # all parameters (every one is read once per forward)
    dtype_bytes: float = 2
    matmul_params: float | None = None  # parameters used in matmuls (default: all)
    layers: int = 0
    attn_dim: int = 0  # heads × head_dim (attention operations per context token)
    kv_dim: int = 0  # kv_heads × head_dim
    source: str = ""

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    kv_dtype_bytes: float | None = None  # the cache's (default: dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> float:
        kv = self.dtype_bytes if self.kv_dtype_bytes is None else self.kv_dtype_bytes
        return 2 * self.layers * self.kv_dim * kv

    def flops_per_token(self, context: int = 0) -> float:
        """2 operations per matmul weight, plus attention's QKᵀ and AV over the context."""
        mm = self.matmul_params if self.matmul_params is not None else self.params
        return 2 * mm + 4 * self.layers * self.attn_dim * context

    def with_dtype(self, dtype: str) -> ModelSpec:
        """Weights in `dtype`; the cache too for float types, bf16 under quantized weights (int8,
        w8a8, int4: models/quant.py quantizes weights only)."""
        kv = DTYPE_BYTES[dtype] if dtype in ("fp32", "bf16", "fp16", "fp8") else 2
        return replace(self, dtype_bytes=DTYPE_BYTES[dtype], kv_dtype_bytes=kv)


def spec_from_config(config: dict, name: str, dtype: str = "bf16") -> ModelSpec:
    """A ModelSpec from a Hugging Face Llama-style config.json (hidden_size, layers, heads...)."""
    try:
        d = config["hidden_size"]
        L = config["num_hidden_layers"]
        H = config["num_attention_heads"]
        V = config["vocab_size"]
        inter = config["intermediate_size"]
    except KeyError as e:
        raise SpecDecodeError(f"{name}: config.json has no {e.args[0]}; give a Llama-style config") from None
    hd = config.get("head_dim") or d // H
    Hkv = config.get("num_key_value_heads") or H
    tied = bool(config.get("tie_word_embeddings", False))
    per_layer = d * H * hd + 2 * d * Hkv * hd + H * hd * d + 3 * d * inter + 2 * d
    embed = V * d
    params = embed * (1 if tied else 2) + L * per_layer + d
    matmul = params - (0 if tied else embed)  # the input embedding is a lookup, not a matmul
    return ModelSpec(name, params, 2, matmul, L, H * hd, Hkv * hd, "config.json").with_dtype(dtype)


def spec_from_path(path: str | Path, dtype: str = "bf16") -> ModelSpec:
    path = Path(path)
    cfg = path / "config.json" if path.is_dir() else path
    if not cfg.exists():
        raise SpecDecodeError(f"{path}: no config.json; pass a model directory or a config.json file")
    try:
        config = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise SpecDecodeError(f"{cfg} is not valid JSON: {e.msg}") from None
    return spec_from_config(config, path.name if path.is_dir() else path.parent.name, dtype)


def forward_time(model: ModelSpec, hw: Hardware, tokens: int, batch: int = 1, context: int = 0) -> dict:
    """Lower bounds for one forward of `tokens` new positions per row for `batch` rows, each row
    attending to `context` cached tokens: max(operations / peak, bytes / bandwidth)."""
    flops = batch * tokens * model.flops_per_token(context)
    bytes_ = model.weight_bytes + batch * (context + tokens) * model.kv_bytes_per_token
    compute_s, memory_s = flops / hw.peak_flops, bytes_ / hw.bandwidth
    return {
        "flops": flops,
        "bytes": bytes_,
        "compute_s": compute_s,
        "memory_s": memory_s,
        "time_s": max(compute_s, memory_s),
        "bound": "compute" if compute_s > memory_s else "memory",
    }
