"""`specdecode init-model`: a random Llama, Qwen2 or Qwen3 checkpoint for tests and experiments."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub) -> None:
    m = sub.add_parser(
        "init-model",
        help="write a random-initialised Llama/Qwen2/Qwen3 checkpoint with a matching tokenizer",
        description="Write a random checkpoint directory (config.json, model.safetensors, "
        "tokenizer files) that transformers and specdecode load offline, made with transformers' own "
        "class for --arch. For tests and experiments.",
    )
    m.add_argument("out", metavar="OUT", help="output directory")
    m.add_argument(
        "--vocab", type=int, required=True, help="vocabulary size (>= 258 gives a byte-level tokenizer)"
    )
    m.add_argument("--layers", type=int, required=True)
    m.add_argument("--dim", type=int, required=True, help="hidden size")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--heads", type=int, default=None, help="attention heads (default dim // 32, at least 1)")
    m.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default = heads)")
    m.add_argument(
        "--arch", default="llama", choices=("llama", "qwen2", "qwen3"), help="architecture (default llama)"
    )
    m.add_argument("--init-std", type=float, default=0.02, help="std of the random weights (default 0.02)")
    m.set_defaults(func=_init_model)


def _init_model(args: argparse.Namespace) -> int:
    from ..models.init import init_model

    out = init_model(
        args.out,
        vocab=args.vocab,
        layers=args.layers,
        dim=args.dim,
        seed=args.seed,
        heads=args.heads,
        kv_heads=args.kv_heads,
        init_std=args.init_std,
        arch=args.arch,
    )
    print(f"wrote a random {args.arch} checkpoint to {Path(out)}", file=sys.stderr)
    return 0
