"""`specdecode chat`: an interactive multi-turn chat through the speculative engine."""

from __future__ import annotations

import argparse
import sys

from ..errors import SpecDecodeError
from .options import add_format_flags, add_sampling_flags, add_spec_flags, open_from_flags, sampling_params


def register(sub) -> None:
    c = sub.add_parser(
        "chat",
        help="talk to a model, turn after turn: answers streamed, drafted tokens coloured",
        description="An interactive chat with MODEL through exact speculative decoding. Each answer is "
        "streamed as rounds finish, every token coloured by how it was made (green: an accepted draft "
        "token; yellow: resampled at a rejection; magenta: the target's bonus token). The conversation "
        "goes through the model's chat template, and with the prefix cache (on with the batch-invariant "
        "forward) each turn reuses the earlier turns' keys and values. Commands: /stats, /reset, "
        "/system TEXT, /temperature T, /help, /exit; Ctrl-C stops an answer, Ctrl-D leaves. Default "
        "model: the Qwen2.5-Coder pair when installed (make models), else smollm2-135m.",
    )
    c.add_argument("--target", metavar="MODEL", help="bundled name or model dir (default: see above)")
    c.add_argument("--draft", metavar="MODEL", help="draft model sharing the target's vocabulary")
    c.add_argument(
        "--method",
        help="drafting method (default: draft with --draft, auto for a known model, else none); "
        "none: no speculation",
    )
    spec = ("k", "policy", "heads", "draft_dtype", "draft_vocab", "draft_vocab_fallback")
    add_spec_flags(c, spec, k=None, policy=None)
    c.add_argument("--system", metavar="TEXT", help="a system message before the conversation")
    add_sampling_flags(
        c,
        ("temperature", "top_p", "seed", "max_new_tokens"),
        flags={"max_new_tokens": "--max-tokens"},
        temperature=0.7,
        top_p=0.95,
        max_new_tokens=512,
    )
    c.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=512,
        metavar="MB",
        help="memory for the earlier turns' keys and values (0: off; default 512)",
    )
    c.add_argument("--no-color", action="store_true", help="plain text, no colours")
    add_format_flags(c)
    c.set_defaults(func=_chat)


def default_target() -> tuple[str, str | None]:
    """The pair when its packages are installed, else SmolLM2-135M (shipped with make install)."""
    from ..demo import PAIR_DRAFT, PAIR_TARGET
    from ..models import ZOO

    if ZOO[PAIR_TARGET].installed() and ZOO[PAIR_DRAFT].installed():
        return PAIR_TARGET, PAIR_DRAFT
    return "smollm2-135m", None


def _chat(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..chat import ChatSession, run_chat
    from ..engine import SpeculativeGenerator
    from ..opener import check_draft_dtype, default_method

    if args.prefix_cache_mb < 0:
        raise SpecDecodeError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    if args.max_new_tokens < 1:
        raise SpecDecodeError(f"--max-tokens must be >= 1, got {args.max_new_tokens}")
    # a seed fixes the text whatever the drafter: turn i is drawn with seed + i, invariant rule
    params = sampling_params(args, sampling_rule="auto")
    target, draft = (args.target, args.draft) if args.target else default_target()
    if args.draft and not args.target:
        raise SpecDecodeError("--draft needs --target")
    method = default_method(target, draft, args.method)
    check_draft_dtype(args.draft_dtype, draft, method)
    console = Console(highlight=False, no_color=args.no_color)
    console.print(f"specdecode chat: loading {target}" + (f" with {draft}" if draft else ""), style="dim")
    loaded = open_from_flags(
        args,
        target,
        draft,
        method,
        lambda line: console.print(line.replace("specdecode:", "specdecode chat:", 1), style="dim"),
        keep_default_policy=args.policy is None,
    )
    gen = SpeculativeGenerator(loaded.target, draft=loaded.draft, config=loaded.config)
    gen.choice = loaded.choice
    cache = "off"
    if args.prefix_cache_mb > 0:
        try:
            gen.enable_prefix_cache(args.prefix_cache_mb << 20)
            cache = f"on ({args.prefix_cache_mb} MB)"
        except SpecDecodeError as e:
            cache = f"off: {e}"
    session = ChatSession(gen, params, system=args.system, console=console)
    what = f"{gen.method}, k = {gen.k}" if gen.method else "no speculation"
    console.print(
        f"specdecode chat: {target} ({what}; prefix cache {cache}). /help lists the commands; "
        "Ctrl-C stops an answer, Ctrl-D leaves.",
        style="dim",
    )
    if sys.stdin.isatty():
        import readline  # noqa: F401 - line editing and history for input()
    return run_chat(session)
