"""`specdecode draft-vocab`: a frequency-ranked draft vocabulary (FR-Spec) from the target's own
answers, for `--draft-vocab FILE`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub) -> None:
    d = sub.add_parser(
        "draft-vocab",
        help="rank the tokens a target emits, for a draft model's smaller LM head (--draft-vocab FILE)",
        description="Answer every prompt of --prompts with TARGET (greedy, target-only, batched), count "
        "the answers' tokens (and those of any --text files, weighted a quarter), and write the --size "
        "most frequent token ids to --out as a JSON list, most frequent first. A draft model run with "
        "--draft-vocab FILE computes logits over those tokens only: a cheaper draft step, some "
        "acceptance lost where the target emits a token outside the list; the output stays the "
        "target's. Build it from prompts you do not benchmark on. The list shipped for the "
        "Qwen2.5-Coder pair was made with: specdecode draft-vocab --target qwen2.5-coder-1.5b "
        "--prompts data/distill-prompts.jsonl --limit 640 --size 32768 --dtype bf16 --out FILE",
    )
    d.add_argument("--target", required=True, metavar="MODEL", help="known name or model directory")
    d.add_argument(
        "--prompts",
        required=True,
        metavar="FILE.jsonl",
        help='one prompt per line: {"prompt": text} or {"messages": [...]}',
    )
    d.add_argument("--out", required=True, metavar="FILE.json")
    d.add_argument("--size", type=int, help="keep the N most frequent ids (default: every id seen)")
    d.add_argument("--limit", type=int, help="only the first N prompts")
    d.add_argument("--max-new-tokens", type=int, default=128, help="answer length cap (default 128)")
    d.add_argument("--batch-size", type=int, default=32, help="prompts answered at once (default 32)")
    d.add_argument("--text", nargs="*", default=[], metavar="FILE", help="text files counted too")
    d.add_argument("--no-chat", action="store_true", help="prompts as raw text (default: chat template)")
    d.add_argument(
        "--dtype", default=None, metavar="FORMAT", help="the target's weight format (default: as generate)"
    )
    d.set_defaults(func=_draft_vocab)


def _draft_vocab(args: argparse.Namespace) -> int:
    from ..errors import SpecDecodeError
    from ..train.draft_vocab import build

    for name in ("size", "limit", "max_new_tokens", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SpecDecodeError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not Path(args.prompts).is_file():
        raise SpecDecodeError(f"--prompts {args.prompts}: no such file")

    def progress(done: int, total: int) -> None:
        print(f"\ranswered {done}/{total} prompts", end="" if done < total else "\n", file=sys.stderr)

    summary = build(
        args.target,
        args.prompts,
        args.out,
        chat=not args.no_chat,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        limit=args.limit,
        texts=[Path(t) for t in args.text],
        size=args.size,
        dtype=args.dtype,
        log=lambda line: print(line, file=sys.stderr),
        progress=progress,
    )
    print(
        f"wrote {args.out}: {summary['ids']:,} token ids from {summary['answer_tokens']:,} answer tokens "
        f"({summary['prompts']} prompts) and {summary['text_tokens']:,} text tokens; they cover "
        f"{summary['answer_coverage']:.1%} of the answers' tokens; {summary['seconds']:.0f} s",
        file=sys.stderr,
    )
    return 0
