"""Weight formats: the one table of how a model's weights may run (`--dtype`, `--draft-dtype`).

Every name the library, the command line and the benchmarks accept is a row here; `weight_format`
maps a name to what `models.load` takes (the activations' torch dtype and the quantization), and
`FORMATS[name].bytes_per_weight` is what a memory-bound step reads. "auto" (the default where it
applies) is not a format: `specdecode.autotune` measures the rows that can run on this machine and
picks one.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SpecDecodeError

AUTO = "auto"
# which runtime runs a model: our lean runtime (Llama, Qwen2, Qwen3), transformers, OpenVINO's
# CPU plugin (models/openvino.py); auto: lean where it can, else transformers
BACKENDS = ("auto", "lean", "hf", "openvino")


@dataclass(frozen=True)
class WeightFormat:
    """name: the short name; activations: the torch dtype name the rows run in; quant: the
    quantization models.load applies (None: float weights as converted); gguf: keeps an installed
    GGUF's own quantized blocks (zoo models only, targets only); bytes_per_weight: what one weight
    costs to read, scales included; draft: a drafter's weights may run so (quantized at build);
    openvino: the OpenVINO engine runs it (models/openvino.py: float constants, or int8 per row /
    int4 per group, symmetric, in OpenVINO's compressed form)."""

    name: str
    activations: str
    quant: str | None
    bytes_per_weight: float
    help: str
    gguf: bool = False
    draft: bool = True
    openvino: bool = True


FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("fp32", "float32", None, 4, "float32 weights and activations"),
        WeightFormat("bf16", "bfloat16", None, 2, "bfloat16 weights and activations"),
        WeightFormat("fp16", "float16", None, 2, "float16 weights and activations"),
        WeightFormat("int8", "bfloat16", "int8", 1, "int8 weights per output row, bf16 activations"),
        WeightFormat("int4", "bfloat16", "int4", 0.5 + 4 / 32, "4-bit weights in groups of 32"),
        WeightFormat("int4-g128", "bfloat16", "int4-g128", 0.5 + 4 / 128, "4-bit weights in groups of 128"),
        # its GEMM takes float32 rows and quantizes each to int8 itself (models/quant.py)
        WeightFormat(
            "w8a8", "float32", "w8a8", 1, "int8 weights x int8 activations per row (FBGEMM)", openvino=False
        ),
        # specdecode's kernel (kernels/): the rows stay float32 and each is quantized to int8 itself
        WeightFormat(
            "kq", "float32", "kq", 0.5 + 16 / 256,
            "GGUF blocks x int8 rows, specdecode's kernel: a GGUF's own, else Q4_K", openvino=False,
        ),
        WeightFormat(
            "kq4", "float32", "kq4", 0.5 + 2 / 32,
            "specdecode's kernel in 4 bits: a GGUF's Q4_K, Q6_K, Q4_0; the rest rounded to Q4_0 (drafts)",
            openvino=False,
        ),
        WeightFormat(
            # gate|up (58% of a layer's weights) at 3.5 bits, the rest at kq4's 4.5
            "kq3", "float32", "kq3", 0.58 * (0.375 + 2 / 32) + 0.42 * (0.5 + 2 / 32),
            "specdecode's kernel in 3 bits: float weights rounded to Q3_0, the head to Q4_0 (drafts)",
            openvino=False,
        ),
        WeightFormat("q4_k", "bfloat16", "q4_k", 0.5 + 12 / 256, "a GGUF's Q4_K blocks", True, False, False),
        WeightFormat("q8_0", "bfloat16", "q8_0", 1 + 2 / 32, "a GGUF's Q8_0 blocks", True, False, False),
    )
}
FLOAT_FORMATS = tuple(n for n, f in FORMATS.items() if f.quant is None)  # fp32, bf16, fp16
QUANT_FORMATS = tuple(n for n, f in FORMATS.items() if f.quant is not None and not f.gguf)
GGUF_FORMATS = tuple(n for n, f in FORMATS.items() if f.gguf)
WEIGHT_FORMATS = tuple(FORMATS)
DRAFT_FORMATS = tuple(n for n, f in FORMATS.items() if f.draft)
OPENVINO_FORMATS = tuple(n for n, f in FORMATS.items() if f.openvino)
DTYPES = {n: FORMATS[n].activations for n in FLOAT_FORMATS}  # short name -> torch dtype name


def check_format(name: str, what: str = "dtype", allow_auto: bool = True, draft: bool = False) -> str:
    """The name if it is a format (or auto); else one line naming the choices."""
    choices = DRAFT_FORMATS if draft else WEIGHT_FORMATS
    if name == AUTO and allow_auto:
        return name
    if name not in choices:
        listed = ", ".join(((AUTO,) if allow_auto else ()) + choices)
        raise SpecDecodeError(f"unknown {what} {name!r}; choose one of {listed}")
    return name


def torch_dtype(name: str):
    """The torch dtype of a float format's short name (fp32, bf16, fp16)."""
    import torch

    if name not in DTYPES:
        raise SpecDecodeError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return getattr(torch, DTYPES[name])


def format_name(dtype, quant: str | None) -> str:
    """The format name of what load() takes: the quantization, else the float dtype's short name."""
    import torch

    if quant is not None:
        return quant
    names = {getattr(torch, a): n for n, a in DTYPES.items()}
    if dtype not in names:
        raise SpecDecodeError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
    return names[dtype]


def weight_format(name: str):
    """(torch dtype of the activations, quantization or None) of a format name, as load() takes them."""
    import torch

    fmt = FORMATS.get(check_format(name, allow_auto=False))
    return getattr(torch, fmt.activations), fmt.quant
