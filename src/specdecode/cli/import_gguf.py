"""`specdecode import-gguf`: a Llama, Qwen2 or Qwen3 GGUF -> a Hugging Face model directory."""

from __future__ import annotations

import argparse
import sys

from ..formats import DTYPES


def register(sub) -> None:
    m = sub.add_parser(
        "import-gguf",
        help="convert a Llama, Qwen2 or Qwen3 GGUF file into a Hugging Face model directory",
        description="Read FILE with the gguf library, dequantize its tensors (any llama.cpp quantization "
        "the library reads: F32, F16, Q8_0, Q5_0, Q4_1, Q4_K, Q6_K, ...), undo llama.cpp's q/k permutation "
        "(Llama), and "
        "write config.json, model.safetensors (in --dtype), tokenizer.json, tokenizer_config.json (with "
        "the chat template) and generation_config.json to --out. The result loads offline in specdecode "
        "and in transformers. Known names such as smollm2-135m and qwen2.5-coder-1.5b are converted "
        "this way on first use.",
    )
    m.add_argument("file", metavar="FILE", help="a .gguf file")
    m.add_argument(
        "--out", required=True, metavar="DIR", help="output model directory (replaced if it exists)"
    )
    m.add_argument("--dtype", default="fp32", choices=tuple(DTYPES), help="stored weight type")
    m.add_argument("--no-progress", action="store_true", help="no progress bar")
    m.set_defaults(func=_import_gguf)


def _import_gguf(args: argparse.Namespace) -> int:
    import torch

    from ..models.gguf_import import import_gguf

    out = import_gguf(args.file, args.out, getattr(torch, DTYPES[args.dtype]), progress=not args.no_progress)
    print(f"wrote {out} (load it with --target {out})", file=sys.stderr)
    return 0
