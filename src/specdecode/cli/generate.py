"""`specdecode generate`: one prompt through the engine, streamed, --json, --trace."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from ..errors import SpecDecodeError
from .options import (
    add_format_flags,
    add_sampling_flags,
    add_sampling_rule_flag,
    add_spec_flags,
    sampling_params,
    spec_config,
)


def register(sub) -> None:
    g = sub.add_parser(
        "generate",
        help="generate text from a prompt (speculative when --draft or --method is given)",
        description="Generate from TARGET. With --draft (or --method) the drafter proposes --k tokens "
        "per round and TARGET verifies them in one forward; without, plain target-only decoding. "
        "Sampling output follows TARGET's distribution exactly; --temperature 0 gives TARGET's "
        "greedy tokens.",
    )
    g.add_argument("--target", required=True, metavar="MODEL", help="bundled name or Hugging Face model dir")
    g.add_argument("--draft", metavar="MODEL", help="draft model sharing the target's vocabulary")
    add_spec_flags(g, policy=None)  # None: open_models' default for the drafter (opener.default_policy)
    add_sampling_flags(g, ("temperature", "top_k", "top_p", "min_p", "seed", "max_new_tokens"))
    add_sampling_rule_flag(g)
    g.add_argument(
        "--num-return-sequences", type=int, default=1, help="independent samples, run as one batch"
    )
    add_sampling_flags(g, ("stop", "ignore_eos"))
    g.add_argument("--prompt", required=True, help="the prompt text (with --chat: the user's message)")
    g.add_argument(
        "--chat",
        action="store_true",
        help="wrap --prompt as a user message in the model's own chat template (from its tokenizer "
        "files) and stop at the template's end-of-turn token",
    )
    g.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the user's")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g.add_argument("--trace", metavar="FILE.jsonl", help="write one JSON line per row per round")
    g.add_argument(
        "--cost-model",
        metavar="FILE.json",
        help="optimal policy: read the costs from FILE if it exists, else measure them on this run and "
        "write FILE (so the next run with the same --seed picks the same k)",
    )
    add_format_flags(g)
    g.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from ..opener import check_draft_dtype

    # validate everything cheap before loading any model
    if args.prompt == "":
        raise SpecDecodeError("--prompt is empty; give at least one character")
    if args.num_return_sequences < 1:
        raise SpecDecodeError(f"--num-return-sequences must be >= 1, got {args.num_return_sequences}")
    check_draft_dtype(args.draft_dtype, args.draft, args.method)
    config = spec_config(args, method=args.method or ("draft" if args.draft else None))
    if args.cost_model and args.policy != "optimal":
        raise SpecDecodeError("--cost-model is read by --policy optimal only")
    params = sampling_params(args)
    from ..engine import SpeculativeGenerator
    from ..engine.policy import CostModel
    from ..engine.stats import GenerationStats
    from ..opener import open_models, spec_fields

    if args.system is not None and not args.chat:
        raise SpecDecodeError("--system needs --chat")
    import warnings

    from ..drafters.early_exit import UntrainedExitWarning

    warnings.simplefilter("ignore", UntrainedExitWarning)  # printed below, with the measured acceptance
    cost_model = None
    if args.cost_model and Path(args.cost_model).exists():
        cost_model = CostModel.load(args.cost_model)
    loaded = open_models(
        args.target,
        draft=args.draft,
        method=config.method,
        dtype=args.dtype,
        draft_dtype=args.draft_dtype,
        backend=args.backend,
        device=args.device,
        batch_invariant=args.batch_invariant,
        **spec_fields(config, keep_default_policy=args.policy is None),
    )
    target, draft = loaded.target, loaded.draft
    config = replace(loaded.config, cost_model=cost_model)
    gen = SpeculativeGenerator(target, draft=draft, config=config)
    n = args.num_return_sequences
    trace = None
    if args.trace:
        try:
            trace = open(args.trace, "w", encoding="utf-8")  # noqa: SIM115
        except OSError as e:
            raise SpecDecodeError(f"cannot write --trace file {args.trace}: {e.strerror}") from None
    # stream as rounds finish (not with stop strings: the stop text must not be shown)
    stream_text = not args.json and n == 1 and target.tokenizer is not None and not args.stop
    shown = ""
    # sample i is seeded seed + i: a seed fixes a row's samples, so one seed for all would repeat one
    seeds = [None if args.seed is None else args.seed + i for i in range(n)]
    prompt = args.prompt
    if args.chat:
        prompt = [{"role": "user", "content": args.prompt}]
        if args.system is not None:
            prompt.insert(0, {"role": "system", "content": args.system})
    events = gen.stream([prompt] * n, [replace(params, seed=s) for s in seeds])
    tokens: list[int] = []
    try:
        for event in events:
            if trace is not None:
                for rec in event.records():
                    trace.write(json.dumps(rec.to_dict(), ensure_ascii=False) + "\n")
            if stream_text and event.emitted:
                tokens.extend(event.emitted[0])
                text = target.tokenizer.decode(tokens)
                if text.startswith(shown) and not text.endswith("\ufffd"):  # only complete characters
                    sys.stdout.write(text[len(shown) :])
                    sys.stdout.flush()
                    shown = text
    finally:
        if trace is not None:
            trace.close()
    results = events.results()
    if args.cost_model and cost_model is None and gen.cost_model is not None:
        gen.cost_model.save(args.cost_model)  # measured on this run: the next one reads it
    stats = GenerationStats.merge([r.stats for r in results], max(r.stats.wall_s for r in results))
    advice = gen.drafter.advice if gen.drafter is not None else None
    if advice:
        measured = (
            f"acceptance on this run {stats.acceptance_rate:.3f}" if stats.drafted else "nothing drafted"
        )
        print(f"specdecode: warning: {advice} ({measured})", file=sys.stderr)
    if args.json:
        out = {"text": results[0].text, "token_ids": results[0].token_ids}
        if n > 1:
            out["samples"] = [{"text": r.text, "token_ids": r.token_ids} for r in results]
        out["stats"] = stats.to_dict() | {"formats": loaded.choice.summary()}
        print(json.dumps(out, ensure_ascii=False))
        return 0
    if stream_text:
        rest = results[0].text[len(shown) :] if results[0].text.startswith(shown) else ""
        print(rest)
    else:
        for i, r in enumerate(results):
            if n > 1:
                print(f"--- sample {i}")
            print(r.text if target.tokenizer is not None else r.token_ids)
    print(
        f"[{stats.new_tokens} tokens in {stats.wall_s:.2f} s, {stats.tokens_per_s:.1f} tokens/s; "
        f"{stats.rounds} rounds, {stats.tokens_per_forward:.2f} tokens per target forward"
        + (f", acceptance {stats.acceptance_rate:.2f}]" if stats.drafted else "]"),
        file=sys.stderr,
    )
    return 0
