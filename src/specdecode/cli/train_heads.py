"""`specdecode train-heads`: Medusa heads or an EAGLE drafter for a frozen target."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import SpecDecodeError


def register(sub) -> None:
    h = sub.add_parser(
        "train-heads",
        help="train a drafter on a frozen target's features (Medusa, EAGLE, EAGLE-3)",
        description="Train Medusa heads for TARGET on CORPUS: head i reads the target's final hidden state "
        "and predicts the token i + 2 places ahead through the target's own LM head. The target is frozen. "
        "Writes OUT/config.json and OUT/heads.safetensors (fp16); use them with "
        "generate --method medusa --heads OUT. --method eagle: a one-layer EAGLE drafter on CORPUS. "
        "--method eagle3: an EAGLE-3 drafter (fused low/middle/high features, training-time test, a "
        "draft vocabulary of the --draft-vocab most frequent answer tokens) trained on --data, made by "
        "`specdecode distill-data`, without running the target; resumable (rerun with the same --out); "
        "writes the vLLM/SGLang checkpoint layout (see `specdecode export`).",
    )
    h.add_argument("--method", default="medusa", help="medusa (default), eagle or eagle3")
    h.add_argument("--target", required=True, metavar="MODEL", help="bundled name or model directory")
    h.add_argument("--corpus", metavar="FILE|DIR", help="medusa / eagle: the target's training corpus")
    h.add_argument("--data", metavar="DIR", help="eagle3: distilled data from `specdecode distill-data`")
    h.add_argument("--out", required=True, metavar="DIR")
    e = h.add_argument_group("eagle3")
    e.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (default 8192)")
    e.add_argument("--ttt-steps", type=int, default=4, help="training-time-test steps (default 4)")
    e.add_argument("--epochs", type=float, default=2.0, help="passes over the data (default 2)")
    e.add_argument("--max-minutes", type=float, help="stop (and finish the schedule) after this long")
    e.add_argument("--batch-tokens", type=int, default=4096, help="tokens per batch (default 4096)")
    e.add_argument("--fp32", action="store_true", help="products in float32 (default: bfloat16 autocast)")
    h.add_argument("--heads", type=int, default=4, help="number of heads (default 4)")
    h.add_argument("--steps", type=int, default=400)
    h.add_argument("--batch-size", type=int, default=16)
    h.add_argument("--seq-len", type=int, default=128)
    h.add_argument("--lr", type=float, help="learning rate (default 1e-3; eagle3 3e-4)")
    h.add_argument("--limit", type=int, help="eagle3: train on the first N sequences only (a quick try)")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--no-progress", action="store_true")
    h.set_defaults(func=_train_heads)


def _train_heads(args: argparse.Namespace) -> int:
    from ..models import resolve

    if args.method not in ("medusa", "eagle", "eagle3"):
        raise SpecDecodeError(f"train-heads --method must be medusa, eagle or eagle3, got {args.method!r}")
    resolve(args.target)
    if args.method == "eagle3":
        return _train_eagle3(args)
    if not args.corpus:
        raise SpecDecodeError(f"--method {args.method} trains on a corpus; pass --corpus FILE|DIR")
    if not Path(args.corpus).exists():
        raise SpecDecodeError(f"corpus {args.corpus} not found; pass the target's training text")
    from ..train.heads import train_eagle, train_medusa

    common = dict(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr if args.lr is not None else 1e-3,
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


def _train_eagle3(args: argparse.Namespace) -> int:
    from ..train.eagle3 import train_eagle3

    if not args.data:
        raise SpecDecodeError("--method eagle3 trains on distilled data; pass --data DIR (see distill-data)")
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise SpecDecodeError(f"--max-minutes must be > 0, got {args.max_minutes}")
    meta = train_eagle3(
        args.target,
        args.data,
        args.out,
        draft_vocab=args.draft_vocab,
        ttt_steps=args.ttt_steps,
        epochs=args.epochs,
        max_minutes=args.max_minutes,
        batch_tokens=args.batch_tokens,
        lr=args.lr if args.lr is not None else 3e-4,
        seed=args.seed,
        limit=args.limit,
        bf16=not args.fp32,
        progress=not args.no_progress and sys.stderr.isatty(),
    )
    accs = " ".join(f"{a:.3f}" for a in meta["heldout_top1_per_step"])
    print(
        f"wrote {args.out}: EAGLE-3 drafter, draft vocabulary covers {meta['draft_vocab_coverage']:.1%} of "
        f"answer tokens, held-out top-1 per step {accs}, {meta['steps']} steps, "
        f"{meta['train_seconds']:.0f} s",
        file=sys.stderr,
    )
    return 0
