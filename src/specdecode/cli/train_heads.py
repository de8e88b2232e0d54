"""`specdecode train-heads`: Medusa heads or an EAGLE drafter for a frozen target."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import SpecDecodeError


def register(sub) -> None:
    h = sub.add_parser(
        "train-heads",
        help="train draft heads (Medusa) on a frozen target's features",
        description="Train Medusa heads for TARGET on CORPUS: head i reads the target's final hidden state "
        "and predicts the token i + 2 places ahead through the target's own LM head. The target is frozen. "
        "Writes OUT/config.json and OUT/heads.safetensors (fp16); use them with "
        "generate --method medusa --heads OUT.",
    )
    h.add_argument("--method", default="medusa", help="medusa (default) or eagle")
    h.add_argument("--target", required=True, metavar="MODEL", help="bundled name or model directory")
    h.add_argument("--corpus", required=True, metavar="FILE|DIR", help="the target's training corpus")
    h.add_argument("--out", required=True, metavar="DIR")
    h.add_argument("--heads", type=int, default=4, help="number of heads (default 4)")
    h.add_argument("--steps", type=int, default=400)
    h.add_argument("--batch-size", type=int, default=16)
    h.add_argument("--seq-len", type=int, default=128)
    h.add_argument("--lr", type=float, default=1e-3)
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--no-progress", action="store_true")
    h.set_defaults(func=_train_heads)


def _train_heads(args: argparse.Namespace) -> int:
    from ..models import resolve

    if args.method not in ("medusa", "eagle"):
        raise SpecDecodeError(f"train-heads --method must be medusa or eagle, got {args.method!r}")
    resolve(args.target)
    if not Path(args.corpus).exists():
        raise SpecDecodeError(f"corpus {args.corpus} not found; pass the target's training text")
    from ..train.heads import train_eagle, train_medusa

    common = dict(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
        progress=not args.no_progress,
    )
    if args.method == "eagle":
        meta = train_eagle(args.target, args.corpus, args.out, **common)
        done = f"EAGLE drafter, held-out top-1 {meta['heldout_top1']:.3f}"
    else:
        meta = train_medusa(args.target, args.corpus, args.out, num_heads=args.heads, **common)
        accs = " ".join(f"{a:.3f}" for a in meta["heldout_top1_per_head"])
        done = f"{meta['num_heads']} heads, held-out top-1 per head {accs}"
    print(f"wrote {args.out}: {done}, {meta['train_seconds']:.0f} s", file=sys.stderr)
    if resolve(args.target).joinpath("training.json").exists():  # held-out prompts need the family
        from ..train.model_card import write_heads_card

        print(f"wrote {write_heads_card(args.out, args.target, args.corpus)}", file=sys.stderr)
    return 0
