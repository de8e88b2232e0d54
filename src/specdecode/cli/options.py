"""Every option of the library as a command-line flag, declared once: each SpecConfig field
(which owns the default and the validation) with its flag and help text (`OPTIONS`), how the
models run (`add_format_flags`: --dtype, --backend, --device, --batch-invariant) and the
sampling rule (`add_sampling_rule_flag`: SamplingParams.sampling_rule, "auto" resolved by
SamplingParams). `generate`, `bench` and `serve` build their flags here, so a new option is
added here and in SpecConfig, nowhere else."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields
from typing import Any

from ..core.config import DRAFT_DTYPES, POLICIES, SpecConfig
from ..core.sampling import RULE_CHOICES, SamplingParams
from ..core.tree import TREE_SAMPLING
from ..errors import SpecDecodeError
from ..formats import BACKENDS, WEIGHT_FORMATS

DTYPE_HELP = (
    "the target's weights: auto (the default for known models such as qwen2.5-coder-1.5b: each "
    "format's step and verification measured on this machine once, the fastest chosen and cached; "
    "fp32 for other models), fp32, bf16, fp16; int8 / int4 / int4-g128 quantized at load "
    "(weight-only: int8 per output row, 4-bit in groups of 32 / 128; bf16 activations); w8a8 (int8 "
    "weights x int8 activations per token, FBGEMM: verification costs about a step); q4_k / q8_0 "
    "keep an installed GGUF's own quantized blocks. Exactness holds relative to the target as it runs"
)


@dataclass(frozen=True)
class Option:
    """One SpecConfig field as a flag: --field-name, typed, with its help text. The default is
    SpecConfig's (a command may override it, e.g. serve's k); validation is SpecConfig's."""

    field: str
    help: str
    type: Any = str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")

    @property
    def default(self) -> Any:
        f = next(f for f in fields(SpecConfig) if f.name == self.field)
        return None if f.default is MISSING else f.default


OPTIONS: tuple[Option, ...] = (
    Option(
        "method",
        "drafting method: draft (default with --draft), ngram, early-exit, medusa, eagle, eagle3, suffix "
        "(SuffixDecoding: continue the longest suffix match in this and earlier requests), auto (suffix "
        "when a long match exists, else the draft model or the trained EAGLE-3 drafter; decided per round)",
    ),
    Option("k", "draft tokens per round (default %(default)s; the start for adaptive policies)", int),
    Option(
        "policy",
        "draft-length policy: fixed (k every round), heuristic (+2 after a fully accepted round, -1 "
        "otherwise), confidence (stop drafting when the draft's probability of its token < "
        "--confidence-threshold), prefix (draft up to --max-k, stopping when the product of the draft's "
        "probabilities of its tokens this round < --confidence-threshold), optimal (k from Theorem 3.8 "
        "with measured acceptance and cost); default: prefix with a draft model in generate, chat "
        "and specdecode.open (measured faster), else fixed",
        choices=POLICIES,
    ),
    Option(
        "confidence_threshold",
        "confidence: a draft token's probability (default 0.4); prefix: the product of a round's "
        "(default: a draft step plus a verified row over a target step, from the measured costs; else 0.4)",
        float,
    ),
    Option("max_k", "heuristic / prefix / optimal: the longest draft (default max(2k, 8))", int),
    Option("exit_layer", "early-exit: draft with the first M layers (default half)", int),
    Option("ngram_max", "ngram: longest suffix to look up (default %(default)s)", int),
    Option("ngram_min", "ngram: shortest suffix to look up (default %(default)s)", int),
    Option(
        "suffix_max", "suffix / auto: the longest draft a suffix match may make (default %(default)s)", int
    ),
    Option(
        "heads",
        "medusa / eagle / eagle3 / auto: the trained heads or drafter (default: the bundled one for the "
        "target, e.g. models/smollm2-135m/eagle3)",
        metavar="DIR",
    ),
    Option(
        "tree",
        "verify a token tree in one forward: branching per depth (3,2,1) or JSON choices "
        "([[0],[1],[0,0]]); each node one of the drafter's top-ranked tokens (or drawn: --tree-sampling)",
        metavar="CHOICES",
    ),
    Option(
        "tree_sampling",
        "how --tree's candidates are chosen: topk (default: the drafter's top-ranked tokens, best for "
        "greedy), with-replacement or without-replacement (drawn from the drafter's distribution and "
        "verified with SpecInfer's / Sequoia's exact multi-candidate rule: better at temperature > 0)",
        choices=TREE_SAMPLING,
    ),
    Option(
        "rollback",
        "hybrid targets (linear-attention layers): undo a rejected draft's recurrent state from a "
        "snapshot per verified position (default) or by replaying the kept positions' inputs from the "
        "state before the round (less memory, a replay per round)",
        choices=("snapshot", "recompute"),
    ),
    Option(
        "draft_dtype",
        "how the drafter's own weights run (draft model, EAGLE/EAGLE-3 layer, Medusa heads): fp32, bf16, "
        "fp16, weight-only quantized int8 / int4 / int4-g128 (4-bit in groups of 32 / 128), w8a8 (int8 "
        "weights and activations), or specdecode's kernel: kq (a GGUF's own blocks), kq4 (4.5 bits a "
        "weight), kq3 (kq4 with the MLP's gate and up in 3-bit blocks). Never "
        "changes the output (the target verifies every token), only the draft's cost and acceptance "
        "(default: auto, the cheapest step measured on this machine, for a draft model of a known "
        "target; else as loaded, the target's format)",
        choices=("auto", *DRAFT_DTYPES),
    ),
    Option(
        "draft_vocab",
        "draft model / auto: its LM head over only the N most frequent tokens (FR-Spec; N lowest token "
        "ids, a JSON file of ids in frequency order made by `specdecode draft-vocab`, or a shipped "
        "list by name: qwen2.5-coder, 32,768 tokens): a cheaper draft step, a little less acceptance; "
        "never changes the output (default: full, the whole vocabulary)",
        type=lambda s: int(s) if s.isdigit() else s,
        metavar="N|FILE.json",
    ),
    Option(
        "draft_vocab_fallback",
        "with --draft-vocab: a row drafts with the whole head in a round where a quarter or more of its "
        "last N tokens (prompt and output) lie outside the list, e.g. prose in a language the list's "
        "corpus lacked; 0: the list's head always. Never changes the output (default: 64)",
        type=int,
        metavar="N",
    ),
)
BY_FIELD = {o.field: o for o in OPTIONS}


SAMPLING_RULE_HELP = (
    "how sampled tokens are drawn, both exact: standard (rejection sampling from each row's own "
    "generator; with a seed the text is fixed for one drafter, k and batch) or invariant (the token at "
    "position t is argmax p_t / E_t with Exp(1) noise keyed by (seed, t); the drafter guesses with the "
    "same noise: a seed fixes the text whatever the drafter, k, tree or batch, at some acceptance; "
    "docs/sampling-rules.md), or auto (invariant for a seeded request, standard otherwise)"
)


def add_format_flags(parser, invariant_help: str | None = None) -> None:
    """--dtype, --backend, --device and --batch-invariant / --no-batch-invariant: how the models run
    (generate, bench, serve); the library's rules behind them are opener.open_models'."""
    parser.add_argument(
        "--dtype", default=None, choices=("auto", *WEIGHT_FORMATS), metavar="FORMAT", help=DTYPE_HELP
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="model runtime: our lean runtime (Llama, Qwen2, Qwen3), transformers (hf), OpenVINO's CPU "
        "plugin (openvino: int4-g128 by default; plain chains, not batch-invariant; docs/openvino.md), "
        "or auto (default: lean where it runs the model, else hf)",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=invariant_help
        or "a token's logits do not depend on how many drafts or rows share the target's forward, so "
        "greedy speculative output equals target-only token for token in every format (default: on for "
        "our lean runtime on CPU; its price is measured in the format choice, docs/batch-invariance.md); "
        "--no-batch-invariant opts out",
    )


@dataclass(frozen=True)
class SamplingOption:
    """One SamplingParams field as a flag (--field-name unless `flag` says otherwise); the default
    is SamplingParams' unless a command overrides it; validation is SamplingParams'."""

    field: str
    help: str
    type: Any = None
    action: str | None = None
    flag: str | None = None

    @property
    def default(self) -> Any:
        f = next(f for f in fields(SamplingParams) if f.name == self.field)
        return f.default_factory() if f.default is MISSING else f.default


SAMPLING_OPTIONS: tuple[SamplingOption, ...] = (
    SamplingOption("temperature", "0 = greedy (default %(default)s)", float),
    SamplingOption("top_k", "keep the K most likely tokens (0 = off; default %(default)s)", int),
    SamplingOption("top_p", "nucleus sampling mass in (0, 1] (default %(default)s; 1 = off)", float),
    SamplingOption("min_p", "drop tokens below P x the top probability (default %(default)s)", float),
    SamplingOption("seed", "random seed (default: fresh randomness)", int),
    SamplingOption("max_new_tokens", "tokens to generate at most (default %(default)s)", int),
    SamplingOption("stop", "stop string (repeatable)", action="append"),
    SamplingOption("ignore_eos", "keep going after the end-of-text token", action="store_true"),
)
SAMPLING_BY_FIELD = {o.field: o for o in SAMPLING_OPTIONS}
# spellings a flag also answers to, whichever a command shows first: the server's and chat's
# max_tokens is generate's max_new_tokens, and both are accepted everywhere
FLAG_ALIASES = {"max_new_tokens": ("--max-new-tokens", "--max-tokens")}


def add_sampling_flags(
    parser, names: tuple[str, ...], flags: dict[str, str] | None = None, **defaults: Any
) -> None:
    """Add these SamplingParams fields as flags; `flags` renames one (chat: max_new_tokens is
    --max-tokens, as in the server's requests; the other spelling in FLAG_ALIASES is accepted
    too), `defaults` overrides SamplingParams' default for this command."""
    for name in names:
        o = SAMPLING_BY_FIELD[name]
        flag = (flags or {}).get(name) or "--" + name.replace("_", "-")
        spellings = [flag, *(a for a in FLAG_ALIASES.get(name, ()) if a != flag)]
        default = defaults.get(name, [] if o.action == "append" else o.default)
        kw: dict[str, Any] = {"dest": name, "default": default, "help": o.help}
        if o.action:
            kw["action"] = o.action
            if o.action == "append":
                kw["metavar"] = "TEXT"
        else:
            kw["type"] = o.type
        parser.add_argument(*spellings, **kw)


def sampling_params(args: argparse.Namespace, **overrides: Any) -> SamplingParams:
    """The SamplingParams of parsed flags (fields a command did not declare keep their defaults),
    validated now; a bad value is SamplingParams' one-line error."""
    values = {o.field: getattr(args, o.field) for o in SAMPLING_OPTIONS if hasattr(args, o.field)}
    if "stop" in values:
        values["stop"] = tuple(values["stop"])
    if hasattr(args, "sampling_rule"):
        values["sampling_rule"] = args.sampling_rule
    return SamplingParams(**(values | overrides))


def add_sampling_rule_flag(parser, default: str = "standard", extra: str = "") -> None:
    """--sampling-rule (generate, bench, serve): SamplingParams.sampling_rule, whose "auto" is
    resolved by SamplingParams (invariant for a seeded row, standard otherwise)."""
    parser.add_argument(
        "--sampling-rule",
        default=default,
        choices=RULE_CHOICES,
        help=SAMPLING_RULE_HELP + (f"; {extra}" if extra else f" (default {default})"),
    )


def add_spec_flags(parser, names: tuple[str, ...] | None = None, **defaults: Any) -> None:
    """Add the flags of these options (all by default) to an argparse parser or group; `defaults`
    overrides SpecConfig's default for this command (None: the command decides later, e.g. per
    model, and its help says so)."""
    for o in OPTIONS if names is None else [BY_FIELD[n] for n in names]:
        default = defaults.get(o.field, o.default)
        text = o.help if default is not None else o.help.replace("default %(default)s", "default: per model")
        parser.add_argument(
            o.flag, type=o.type, default=default, choices=o.choices, metavar=o.metavar, help=text
        )


def spec_config(args: argparse.Namespace, **overrides: Any) -> SpecConfig:
    """The SpecConfig of parsed flags (options a command did not declare keep their defaults),
    validated now, before any model loads: a bad value is SpecConfig's one-line error."""
    values = {o.field: getattr(args, o.field) for o in OPTIONS if getattr(args, o.field, None) is not None}
    if values.get("draft_dtype") == "auto":  # a choice opener.open_models makes, not a SpecConfig value
        del values["draft_dtype"]
    values.update(overrides)
    try:
        return SpecConfig(**values)
    except SpecDecodeError as e:  # name the flag: "k must be ..." -> "--k must be ..."
        o = next((o for o in OPTIONS if str(e).startswith(o.field + " ")), None)
        if o is None:
            raise
        raise SpecDecodeError(o.flag + str(e)[len(o.field) :]) from None


def open_from_flags(args: argparse.Namespace, target: str, draft: str | None, method: str | None, log, **kw):
    """The models and SpecConfig of a command's parsed flags (serve, chat): k's default from the
    opener, the spec flags validated, the format flags, through opener.open_models."""
    from ..opener import default_k, open_models, spec_fields

    k = args.k or default_k(target)
    options = spec_fields(spec_config(args, k=k, method=method), **kw)
    options.pop("k")
    return open_models(
        target,
        draft=draft,
        method=method,
        k=k,
        dtype=args.dtype,
        draft_dtype=args.draft_dtype,
        backend=args.backend,
        device=args.device,
        batch_invariant=args.batch_invariant,
        log=log,
        **options,
    )
