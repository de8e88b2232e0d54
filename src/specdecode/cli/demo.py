"""`specdecode demo`: the main job, the bundled pairs coloured with the measured speed-up."""

from __future__ import annotations

import argparse
import json

from ..errors import SpecDecodeError


def register(sub) -> None:
    d = sub.add_parser(
        "demo",
        help="speculative decoding on the bundled model pairs, coloured, with the measured speed-up",
        description="Run the bundled three-kingdoms and python-code pairs: stream the text with each token "
        "coloured by how it was produced (accepted draft / resampled / bonus), then a table of acceptance, "
        "tokens per target forward, the formula (1 - a^(k+1))/(1 - a), and the wall-clock speed-up over "
        "target-only decoding measured in the same run.",
    )
    d.add_argument("--k", type=int, default=4, help="draft tokens per round (default 4)")
    d.add_argument("--max-new-tokens", type=int, default=96)
    d.add_argument("--temperature", type=float, default=0.8)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--repeats", type=int, default=3, help="timed runs per decoding mode (default 3)")
    d.add_argument("--json", action="store_true", help="also print the table rows as JSON")
    d.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo
    from ..sampling import SamplingParams

    if args.k < 1:
        raise SpecDecodeError(f"--k must be >= 1, got {args.k}")
    if args.repeats < 1:
        raise SpecDecodeError(f"--repeats must be >= 1, got {args.repeats}")
    SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)  # validates
    rows = run_demo(
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        repeats=args.repeats,
    )
    if args.json:
        print(json.dumps(rows))
    return 0
