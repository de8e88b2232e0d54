"""`specdecode demo`: the main job, a coding assistant on the real pair coloured with the
measured speed-up (--small: SmolLM2 chat; --lesson: the lesson's bundled pairs)."""

from __future__ import annotations

import argparse
import json

from ..errors import SpecDecodeError
from ..formats import DRAFT_FORMATS, WEIGHT_FORMATS


def register(sub) -> None:
    d = sub.add_parser(
        "demo",
        help="a coding assistant on Qwen2.5-Coder-1.5B made faster: coloured tokens, measured speed-up",
        description="A coding assistant on qwen2.5-coder-1.5b with qwen2.5-coder-0.5b as draft (installed by "
        "`make models`): stream an answer drafted by the 0.5B model, each token coloured by how it was "
        "produced (accepted draft / resampled / bonus), then a table of target-only decoding against the "
        "draft model, suffix (copies from the prompt and earlier answers) and auto (suffix where the match "
        "is long, else the draft model) on four coding prompts (an edit, type hints, a function with tests, "
        "an explanation): tokens/s, tokens "
        "per target forward, the draft's measured cost c, the wall-clock speed-up and whether each method's "
        "tokens equal target-only's, in the same run. "
        "--small: chat with smollm2-135m and its bundled EAGLE-3 drafter instead. --lesson: the lesson's "
        "bundled three-kingdoms and python-code pairs, with acceptance and the formula "
        "(1 - a^(k+1))/(1 - a).",
    )
    which = d.add_mutually_exclusive_group()
    which.add_argument("--small", action="store_true", help="chat with SmolLM2-135M (eagle3, ngram, auto)")
    which.add_argument("--lesson", action="store_true", help="run the lesson's bundled model pairs instead")
    d.add_argument("--k", type=int, help="draft tokens per round (default 4; --small 2)")
    d.add_argument(
        "--max-new-tokens", type=int, help="tokens per answer (default 96; --small 128; --lesson 96)"
    )
    d.add_argument(
        "--dtype",
        choices=("auto", *WEIGHT_FORMATS),
        metavar="FORMAT",
        help="the pair's target format (default auto: each format measured on this machine once, the "
        "fastest verification round chosen; target-only also runs in the fastest step's format)",
    )
    d.add_argument(
        "--draft-dtype",
        choices=("auto", *DRAFT_FORMATS),
        metavar="FORMAT",
        help="the draft's format (default auto: the cheapest measured step)",
    )
    d.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the pair's forward batch-invariant (default on: greedy output equals target-only token for "
        "token; see docs/batch-invariance.md)",
    )
    d.add_argument("--temperature", type=float, help="default 0 (greedy); --lesson 0.8")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--repeats", type=int, default=3, help="timed runs per decoding mode (default 3)")
    d.add_argument("--json", action="store_true", help="also print the table rows as JSON")
    d.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from ..core.sampling import SamplingParams
    from ..demo import run_demo

    args.k = args.k if args.k is not None else (2 if args.small else 4)
    if args.k < 1:
        raise SpecDecodeError(f"--k must be >= 1, got {args.k}")
    if args.repeats < 1:
        raise SpecDecodeError(f"--repeats must be >= 1, got {args.repeats}")
    max_new = args.max_new_tokens or (128 if args.small else 96)
    temperature = args.temperature if args.temperature is not None else (0.8 if args.lesson else 0.0)
    SamplingParams(temperature=temperature, max_new_tokens=max_new)  # validates
    if args.lesson:
        rows = run_demo(
            k=args.k, max_new_tokens=max_new, temperature=temperature, seed=args.seed, repeats=args.repeats
        )
    elif args.small:
        from ..demo import run_chat_demo

        rows = run_chat_demo(k=args.k, max_new_tokens=max_new, temperature=temperature, seed=args.seed)
    else:
        from ..demo import run_pair_demo

        rows = run_pair_demo(
            k=args.k,
            max_new_tokens=max_new,
            temperature=temperature,
            seed=args.seed,
            dtype=args.dtype,
            draft_dtype=args.draft_dtype,
            batch_invariant=args.batch_invariant,
        )
    if args.json:
        print(json.dumps(rows))
    return 0
