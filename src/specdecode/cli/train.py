"""`specdecode train`: a model family (tokenizer, target, drafts) from a corpus."""

from __future__ import annotations

import argparse
import sys

from ..errors import SpecDecodeError


def register(sub) -> None:
    t = sub.add_parser(
        "train",
        help="train a model family (tokenizer + target + drafts) on a corpus",
        description="Train a byte-level BPE tokenizer on CORPUS (5%% held out), then every model of the "
        "family on the same token stream for the same number of steps. Each model directory keeps "
        "its lowest held-out loss checkpoint (fp16 safetensors, Hugging Face format).",
    )
    t.add_argument("--corpus", required=True, metavar="FILE|DIR", help="a text file, or a directory of files")
    t.add_argument("--family", required=True, help="three-kingdoms or python-code")
    t.add_argument("--out", required=True, metavar="DIR", help="writes DIR/<model>/ for every model")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (family default)")
    t.add_argument("--seq-len", type=int, default=None, help="tokens per training sequence (family default)")
    t.add_argument("--batch-size", type=int, default=None, help="sequences per step (family default)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (family default)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations")
    t.add_argument("--resume", action="store_true", help="continue the unfinished run in --out")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    t.add_argument("--models", default="", help="comma-separated models of the family to train (default all)")
    t.add_argument(
        "--early-exit-layer",
        type=int,
        default=0,
        help="also train the target to predict from its first M layers (for --method early-exit)",
    )
    t.add_argument("--early-exit-weight", type=float, default=0.5, help="weight of that auxiliary loss")
    t.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from ..train.families import FAMILIES
    from ..train.trainer import train_family

    family = FAMILIES.get(args.family)
    if family is None:
        raise SpecDecodeError(f"unknown --family {args.family!r}; choose one of {', '.join(FAMILIES)}")
    result = train_family(
        family,
        args.corpus,
        args.out,
        steps=family.steps if args.steps is None else args.steps,
        seq_len=family.seq_len if args.seq_len is None else args.seq_len,
        batch_size=family.batch_size if args.batch_size is None else args.batch_size,
        lr=family.lr if args.lr is None else args.lr,
        seed=args.seed,
        resume=args.resume,
        eval_every=args.eval_every,
        progress=not args.no_progress,
        early_exit_layer=args.early_exit_layer,
        early_exit_weight=args.early_exit_weight if args.early_exit_layer else 0.0,
        only=tuple(m for m in args.models.split(",") if m),
    )
    from ..train.model_card import write_model_cards

    write_model_cards(args.out, args.corpus, only=tuple(m for m in args.models.split(",") if m))
    for m in result["models"]:
        print(
            f"{args.out}/{m['name']}: {m['params']:,} params, best held-out loss {m['best_val_loss']:.4f} "
            f"at step {m['best_step']}, {m['train_seconds']:.0f} s",
            file=sys.stderr,
        )
    return 0
