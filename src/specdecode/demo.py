"""`specdecode demo`: speculative decoding on the bundled pairs, each token coloured by how it
was produced, then acceptance, tokens per forward, the formula, and the measured speed-up."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .chat import STYLE, stream_coloured
from .core.theory import expected_tokens_per_round
from .errors import SpecDecodeError


@dataclass(frozen=True)
class DemoPair:
    family: str
    target: str
    draft: str
    prompt: str


PAIRS = (
    DemoPair("three-kingdoms", "three-kingdoms/target", "three-kingdoms/draft-64", "孔明曰：「"),
    DemoPair("python-code", "python-code/target", "python-code/draft", "def fibonacci(n):\n"),
)


def _stream_coloured(console: Console, gen, tokenizer, prompt, params, label: str | None = None) -> None:
    """Print the prompt (or `label` for a chat), then every emitted token in the colour of how it
    was produced."""
    console.print(Text(prompt if label is None else label, style="bold"), end="")
    stream_coloured(console, gen.stream([prompt], params), tokenizer)
    console.print()


def _tokens_per_s(gen, prompt: str, params) -> tuple[float, object]:
    (res,) = gen.generate([prompt], params)
    return res.stats.tokens_per_s, res.stats


def run_demo(
    *,
    k: int = 4,
    max_new_tokens: int = 96,
    temperature: float = 0.8,
    seed: int = 0,
    repeats: int = 3,
    console: Console | None = None,
) -> list[dict]:
    """Run every bundled pair that is present; return the table rows."""
    from .core.sampling import SamplingParams
    from .engine import SpeculativeGenerator
    from .models import load, models_dir

    console = console or Console()
    pairs = [
        p
        for p in PAIRS
        if (models_dir() / p.target / "config.json").exists()
        and (models_dir() / p.draft / "config.json").exists()
    ]
    if not pairs:
        raise SpecDecodeError(f"no bundled models in {models_dir()}; train them with `specdecode train`")
    legend = Text("colours: ")
    for how, style in STYLE.items():
        legend.append(f"{how} ", style=style)
    console.print(legend)
    rows = []
    for pair in pairs:
        target, draft = load(pair.target), load(pair.draft)
        spec = SpeculativeGenerator(target, draft=draft, k=k)
        plain = SpeculativeGenerator(target)
        params = SamplingParams(
            temperature=temperature, max_new_tokens=max_new_tokens, seed=seed, ignore_eos=True
        )
        console.rule(f"{pair.family}: {pair.target} + {pair.draft}, k = {k}, T = {temperature}")
        _stream_coloured(console, spec, target.tokenizer, pair.prompt, params)
        # timing: warm up, then target-only and speculative interleaved, medians
        warm = SamplingParams(temperature=temperature, max_new_tokens=8, seed=seed, ignore_eos=True)
        plain.generate([pair.prompt], warm)
        spec.generate([pair.prompt], warm)
        plain_tps, spec_tps, alphas, tpf = [], [], [], []
        for r in range(repeats):
            p = SamplingParams(
                temperature=temperature, max_new_tokens=max_new_tokens, seed=seed + r, ignore_eos=True
            )
            plain_tps.append(_tokens_per_s(plain, pair.prompt, p)[0])
            tps, st = _tokens_per_s(spec, pair.prompt, p)
            spec_tps.append(tps)
            alphas.append(st.acceptance_rate)
            tpf.append(st.tokens_per_forward)
        alpha = statistics.mean(alphas)
        rows.append(
            {
                "family": pair.family,
                "acceptance_rate": alpha,
                "tokens_per_forward": statistics.mean(tpf),
                "formula_tokens_per_round": expected_tokens_per_round(alpha, k),
                "target_only_tokens_per_s": statistics.median(plain_tps),
                "speculative_tokens_per_s": statistics.median(spec_tps),
                "speedup": statistics.median(spec_tps) / statistics.median(plain_tps),
            }
        )
    table = Table(
        title=f"speculative decoding, k = {k}, T = {temperature}, {max_new_tokens} new tokens, "
        f"median of {repeats} runs"
    )
    for col in ("pair", "α", "tokens/fwd", "formula", "target tok/s", "spec tok/s", "speed-up"):
        table.add_column(col, justify="right" if col != "pair" else "left")
    for r in rows:
        table.add_row(
            r["family"],
            f"{r['acceptance_rate']:.3f}",
            f"{r['tokens_per_forward']:.2f}",
            f"{r['formula_tokens_per_round']:.2f}",
            f"{r['target_only_tokens_per_s']:.0f}",
            f"{r['speculative_tokens_per_s']:.0f}",
            f"{r['speedup']:.2f}x",
        )
    console.print(table)
    console.print(
        "α: acceptance rate of the draft tokens the target checked; tokens/fwd: measured tokens per "
        "target forward; formula: (1 − α^(k+1)) / (1 − α), which assumes each position is accepted "
        "independently with probability α; tok/s: wall clock, target-only and speculative, same run."
    )
    return rows


CHAT_MODEL = "smollm2-135m"
CHAT_PROMPTS = (
    "Write a short, friendly email to a colleague asking to move our Friday meeting to Monday.",
    "Summarize in two sentences: The city council met on Tuesday to discuss the new bicycle lanes. "
    "Council members agreed that the lanes on Main Street had reduced traffic accidents by a third "
    "since they opened last spring. They voted to build new lanes on Oak Avenue and River Road next "
    "year, paid for by the transport budget, and asked residents to send comments before March.",
    "Explain what a hash table is and why looking up a key is fast.",
)
CHAT_METHODS = ("eagle3", "ngram", "auto")

# the coding assistant on the real pair: an edit, type hints, a function with tests, an explanation
PAIR_TARGET, PAIR_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
CODE_PROMPTS = (
    "Rename the variable `lst` to `numbers` in this function and change nothing else:\n```python\n"
    "def average(lst):\n    if not lst:\n        return 0.0\n    total = 0\n    for x in lst:\n"
    "        total += x\n    return total / len(lst)\n```",
    "Add type hints to this function and return the whole function:\n```python\n"
    "def merge_counts(a, b):\n    out = dict(a)\n    for key, value in b.items():\n"
    "        out[key] = out.get(key, 0) + value\n    return out\n```",
    "Write a Python function `is_palindrome(s)` that ignores case and spaces, and three pytest tests for it.",
    "Explain in two sentences what this code does:\n```python\nseen = set()\n"
    "unique = [x for x in items if not (x in seen or seen.add(x))]\n```",
)
PAIR_METHODS = ("draft", "suffix", "auto")


def _method_table(console: Console, target, gens: dict, chats: list, params, title: str) -> list[dict]:
    """Every generator on every chat, interleaved (the order rotates per prompt) after a warm-up;
    print and return rows of tokens/s, tau and the speed-up over gens['target-only']."""
    from .core.sampling import SamplingParams
    for g in gens.values():  # warm-up, then forgotten: no timed run drafts from a warm-up's answer
        g.generate(
            [chats[0]], SamplingParams(temperature=params.temperature, max_new_tokens=8, seed=params.seed)
        )
        g.forget()
    stats: dict[str, list] = {name: [] for name in gens}
    outputs: dict[str, list] = {name: [] for name in gens}
    for i, chat in enumerate(chats):
        names = list(gens)
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate the order
            (res,) = gens[name].generate([chat], params)
            stats[name].append(res.stats)
            outputs[name].append(list(res.token_ids))
    # the speed-up is over the fastest target-only run (the pair's demo may run target-only in two
    # formats: the speculative target's, for 'same tokens', and the fastest step's)
    base_tps = max(
        sum(s.new_tokens for s in lst) / sum(s.wall_s for s in lst)
        for name, lst in stats.items()
        if name.startswith("target-only")
    )
    rows = []
    for name, lst in stats.items():
        tokens, secs = sum(s.new_tokens for s in lst), sum(s.wall_s for s in lst)
        fwd = sum(s.rounds for s in lst)
        drafted = sum(s.drafted for s in lst)
        draft_s, target_s = sum(s.draft_s for s in lst), sum(s.target_s for s in lst)
        rows.append(
            {
                "method": name,
                "tokens": tokens,
                "tokens_per_s": tokens / secs,
                "tau": tokens / fwd if fwd else None,
                "speedup": tokens / secs / base_tps,
                "cost_ratio": (draft_s / drafted) / (target_s / fwd)
                if drafted and fwd and target_s
                else None,
                "identical_to_target_only": outputs[name] == outputs["target-only"],
            }
        )
    table = Table(title=title)
    for col in ("method", "tokens", "tok/s", "τ (tokens/forward)", "draft cost c", "speed-up", "same tokens"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        c = f"{r['cost_ratio']:.2f}" if r["cost_ratio"] else "-"
        same = "yes" if r["identical_to_target_only"] else "NO"
        table.add_row(
            r["method"], str(r["tokens"]), f"{r['tokens_per_s']:.2f}", tau, c, f"{r['speedup']:.2f}x", same
        )
    console.print(table)
    return rows


def _stream_first(console: Console, gen, target, chat, params, what: str, title: str) -> None:
    legend = Text("colours: ")
    for how, style in STYLE.items():
        legend.append(f"{how} ", style=style)
    console.rule(title)
    console.print(legend)
    console.print(Text(f"user: {chat[-1]['content']}", style="bold"))
    _stream_coloured(console, gen, target.tokenizer, chat, params, label=f"assistant ({what}): ")


def run_chat_demo(
    *,
    k: int = 2,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    methods: tuple[str, ...] = CHAT_METHODS,
    prompts: tuple[str, ...] = CHAT_PROMPTS,
    console: Console | None = None,
) -> list[dict]:
    """Chat with SmolLM2-135M-Instruct: the first prompt streamed with the bundled EAGLE-3
    drafter, tokens coloured by provenance; then target-only and each method on every prompt,
    interleaved in this one process after a warm-up, with tokens/s, tau and the speed-up."""
    import torch

    from .core.sampling import SamplingParams
    from .engine import SpeculativeGenerator
    from .models import load
    from .opener import method_heads

    console = console or Console()
    target = load(CHAT_MODEL, dtype=torch.bfloat16)
    # batch-invariant: in bf16 the plain forward rounds a token's logits differently with the
    # number of tokens per forward, so greedy drafts could leave target-only after a near-tie
    gens = {"target-only": SpeculativeGenerator(target, batch_invariant=True)}
    for m in methods:
        heads = method_heads(CHAT_MODEL, m, None)
        if m == "eagle3" and heads is None:
            raise SpecDecodeError(f"no EAGLE-3 drafter bundled for {CHAT_MODEL}")
        gens[m] = SpeculativeGenerator(target, k=k, method=m, heads=heads, batch_invariant=True)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    title = f"{CHAT_MODEL} (bf16, batch-invariant) + {methods[0]}, k = {k}, T = {temperature}"
    _stream_first(console, gens[methods[0]], target, chats[0], params, methods[0], title)
    rows = _method_table(
        console,
        target,
        gens,
        chats,
        params,
        f"{CHAT_MODEL}, bf16 batch-invariant, k = {k}, T = {temperature}, {len(prompts)} prompts, "
        f"{max_new_tokens} new tokens at most, batch 1, this machine",
    )
    console.print(
        "Greedy output is the target's own with every method (same tokens: the forward is "
        "batch-invariant); the speed-up is wall clock over target-only in this run. "
        "`specdecode demo --lesson` runs the lesson's bundled pairs."
    )
    return rows


def run_pair_demo(
    *,
    k: int = 4,
    max_new_tokens: int = 96,
    temperature: float = 0.0,
    seed: int = 0,
    methods: tuple[str, ...] = PAIR_METHODS,
    prompts: tuple[str, ...] = CODE_PROMPTS,
    dtype: str | None = None,
    draft_dtype: str | None = None,
    batch_invariant: bool | None = None,
    console: Console | None = None,
) -> list[dict]:
    """A coding assistant on Qwen2.5-Coder-1.5B-Instruct with its 0.5B sibling as draft: the
    first answer streamed with the draft model, tokens coloured by provenance; then target-only
    and each method on every prompt, interleaved after a warm-up: tokens/s, tau, the draft's
    cost c, the speed-up, and whether each method's tokens equal target-only's.

    dtype / draft_dtype: the formats (default auto: measured on this machine, opener.open_models);
    batch_invariant (default on) makes 'same tokens' exact whatever the number of tokens per
    forward. When the fastest target-only format differs from the speculative target's, target-only
    runs in both: the speed-up is over the faster, 'same tokens' compares with the same format's."""
    from .autotune import best_step
    from .core.sampling import SamplingParams
    from .engine import SpeculativeGenerator
    from .models import load
    from .opener import open_models

    console = console or Console()
    with console.status(f"loading {PAIR_TARGET} and {PAIR_DRAFT} (formats: measured once per machine)"):
        loaded = open_models(
            PAIR_TARGET,
            draft=PAIR_DRAFT,
            k=k,
            dtype=dtype,
            draft_dtype=draft_dtype,
            batch_invariant=batch_invariant,
            log=lambda line: console.print(line, markup=False, highlight=False),
        )
    target, draft, choice = loaded.target, loaded.draft, loaded.choice
    t_name, d_name = choice.target, choice.draft
    invariant = bool(loaded.config.batch_invariant)
    gens = {"target-only": SpeculativeGenerator(target, batch_invariant=invariant)}
    solo = best_step(choice) if dtype in (None, "auto") else None
    if solo is not None and solo != t_name:
        from .formats import weight_format

        s_dtype, s_quant = weight_format(solo)
        with console.status(f"loading {PAIR_TARGET} ({solo}: the fastest target-only step here)"):
            fastest = load(PAIR_TARGET, dtype=s_dtype, quant=s_quant)
        gens[f"target-only ({solo})"] = SpeculativeGenerator(fastest, batch_invariant=invariant)
    for m in methods:
        drafts = m in ("draft", "auto")  # the draft model (its head as open_models configured it)
        gens[m] = SpeculativeGenerator(
            target,
            draft=draft if drafts else None,
            k=k,
            method=m,
            batch_invariant=invariant,
            draft_vocab=loaded.config.draft_vocab if drafts else None,
            policy=loaded.config.policy if drafts else "fixed",  # prefix (opener.default_policy)
            confidence_threshold=loaded.config.confidence_threshold if drafts else None,
        )
    forward = "batch-invariant" if invariant else "plain forward"
    chats = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    shown = methods[0]
    cfg = loaded.config
    drafting = (  # what k means for the draft model's rows under its policy
        f"up to {gens['draft'].config.max_draft} tokens a round, stopping below {cfg.confidence_threshold:g} "
        "(prefix policy)"
        if cfg.policy == "prefix" and "draft" in gens and cfg.confidence_threshold is not None
        else f"k = {k}"
    )
    title = f"{PAIR_TARGET} ({t_name}) + {PAIR_DRAFT} ({d_name}) as {shown}, {drafting}, T = {temperature}, "
    title += forward
    _stream_first(console, gens[shown], target, chats[0], params, shown, title)
    rows = _method_table(
        console,
        target,
        gens,
        chats,
        params,
        f"coding assistant: {PAIR_TARGET} {t_name} (draft {PAIR_DRAFT} {d_name}), {forward}, "
        f"{drafting}, T = {temperature}, {len(prompts)} prompts, {max_new_tokens} new tokens at most, "
        "batch 1, this machine",
    )
    console.print(
        "Greedy output is the target's own with every method ('same tokens': equal to target-only's, "
        "token for token); draft: the 0.5B model drafts; suffix: copies from the prompt "
        "and earlier answers; auto: suffix where the match is long, else the draft model. c: the "
        "drafter's seconds per draft token over the target's per forward, measured. "
        "`specdecode demo --small` chats with SmolLM2-135M; `--lesson` runs the lesson's pairs."
    )
    return rows
