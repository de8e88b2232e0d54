"""`specdecode model-card`: MODEL_CARD.md for every model of a trained family."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import SpecDecodeError


def register(sub) -> None:
    c = sub.add_parser(
        "model-card",
        help="write MODEL_CARD.md for every model of a trained family",
        description="Write MODEL_CARD.md into every model directory under DIR from its training.json, "
        "measuring each draft's acceptance against the family's target (k = 4, T = 1 and T = 0) on "
        "prompts from the held-out 5%% of the corpus.",
    )
    c.add_argument("dir", metavar="DIR", help="a family directory written by `specdecode train`")
    c.add_argument(
        "--corpus", default=None, help="the training corpus (default: the path recorded at training)"
    )
    c.add_argument("--prompts", type=int, default=8, help="held-out prompts (default 8)")
    c.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    c.set_defaults(func=_model_card)


def _model_card(args: argparse.Namespace) -> int:
    from ..train.model_card import write_model_cards

    if args.prompts < 1 or args.new_tokens < 1:
        raise SpecDecodeError("--prompts and --new-tokens must be >= 1")
    if not Path(args.dir).is_dir():
        raise SpecDecodeError(
            f"{args.dir} is not a directory; pass a family directory written by `specdecode train`"
        )
    for path in write_model_cards(args.dir, args.corpus, prompts=args.prompts, new_tokens=args.new_tokens):
        print(f"wrote {path}", file=sys.stderr)
    return 0
