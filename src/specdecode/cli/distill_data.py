"""`specdecode distill-data`: the target's answers to a prompt set, with its features, for
training a drafter (self-distillation)."""

from __future__ import annotations

import argparse
import sys

from ..formats import DTYPES


def register(sub) -> None:
    d = sub.add_parser(
        "distill-data",
        help="generate a drafter's training data: the target's own answers and its hidden states",
        description="Answer every prompt of --prompts with TARGET (batched, rows admitted as others "
        "finish) and store the tokens with the target's features: the residual streams entering its "
        "low, middle and high layers (EAGLE-3's inputs) and its final hidden states (so training can "
        "match the target's distribution), float16, memory-mapped. Training then never runs the "
        "target. Resumable: rerun with the same --out to continue. Example: specdecode distill-data "
        "--target smollm2-135m --prompts data/distill-prompts.jsonl --out distill/smollm2 --chat",
    )
    d.add_argument("--target", required=True, metavar="MODEL", help="known name or Llama model directory")
    d.add_argument(
        "--prompts",
        required=True,
        metavar="FILE.jsonl",
        help='one prompt per line: {"prompt": text}, {"messages": [...]} or {"turns": [text, ...]}',
    )
    d.add_argument("--out", required=True, metavar="DIR")
    d.add_argument("--chat", action="store_true", help="wrap each prompt in the target's chat template")
    d.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap (default 256)")
    d.add_argument(
        "--temperature",
        default="0",
        metavar="T[,T...]",
        help="sampling temperature; with several (0,0,1) prompt i uses the (i mod n)-th (default 0)",
    )
    d.add_argument("--batch-size", type=int, default=32, help="rows decoded at once (default 32)")
    d.add_argument("--limit", type=int, help="only the first N prompts")
    d.add_argument(
        "--dtype", default="bf16", choices=tuple(DTYPES), help="the target's weight type (default bf16)"
    )
    d.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed + i")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=_distill)


def _distill(args: argparse.Namespace) -> int:
    import torch

    from ..errors import SpecDecodeError
    from ..train.distill import distill

    if args.limit is not None and args.limit < 1:
        raise SpecDecodeError(f"--limit must be >= 1, got {args.limit}")
    index = distill(
        args.target,
        args.prompts,
        args.out,
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        batch_size=args.batch_size,
        dtype=getattr(torch, DTYPES[args.dtype]),
        limit=args.limit,
        seed=args.seed,
        progress=not args.no_progress and sys.stderr.isatty(),
    )
    print(
        f"wrote {args.out}: {len(index['sequences'])} sequences, {index['num_tokens']:,} tokens, "
        f"{index['generate_seconds']:.0f} s",
        file=sys.stderr,
    )
    return 0
