"""`specdecode demo`: the main job, the bundled pairs coloured with the measured speed-up."""

from __future__ import annotations

import argparse
import json

from ..errors import SpecDecodeError


def register(sub) -> None:
    d = sub.add_parser(
        "demo",
        help="chat with SmolLM2-135M made faster: coloured tokens and the measured speed-up",
        description="Chat with smollm2-135m (bf16): stream an answer drafted by the bundled EAGLE-3 drafter, "
        "each token coloured by how it was produced (accepted draft / resampled / bonus), then a table of "
        "target-only decoding against eagle3, ngram (prompt lookup) and auto (suffix match or EAGLE-3, per "
        "round) on a few prompts: tokens/s, tokens per target forward and the wall-clock speed-up, measured "
        "in the same run. --lesson: the lesson's bundled three-kingdoms and python-code pairs instead, with "
        "acceptance and the formula (1 - a^(k+1))/(1 - a).",
    )
    d.add_argument("--lesson", action="store_true", help="run the lesson's bundled model pairs instead")
    d.add_argument("--k", type=int, help="draft tokens per round (default 2; --lesson 4)")
    d.add_argument("--max-new-tokens", type=int, help="tokens per answer (default 128; --lesson 96)")
    d.add_argument("--temperature", type=float, help="default 0 (greedy); --lesson 0.8")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--repeats", type=int, default=3, help="timed runs per decoding mode (default 3)")
    d.add_argument("--json", action="store_true", help="also print the table rows as JSON")
    d.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo
    from ..sampling import SamplingParams

    args.k = args.k if args.k is not None else (4 if args.lesson else 2)
    if args.k < 1:
        raise SpecDecodeError(f"--k must be >= 1, got {args.k}")
    if args.repeats < 1:
        raise SpecDecodeError(f"--repeats must be >= 1, got {args.repeats}")
    max_new = args.max_new_tokens or (96 if args.lesson else 128)
    temperature = args.temperature if args.temperature is not None else (0.8 if args.lesson else 0.0)
    SamplingParams(temperature=temperature, max_new_tokens=max_new)  # validates
    if args.lesson:
        rows = run_demo(
            k=args.k, max_new_tokens=max_new, temperature=temperature, seed=args.seed, repeats=args.repeats
        )
    else:
        from ..demo import run_chat_demo

        rows = run_chat_demo(k=args.k, max_new_tokens=max_new, temperature=temperature, seed=args.seed)
    if args.json:
        print(json.dumps(rows))
    return 0
