"""`specdecode demo`: speculative decoding on the bundled pairs, each token coloured by how it
was produced, then acceptance, tokens per forward, the formula, and the measured speed-up."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .errors import SpecDecodeError
from .theory import expected_tokens_per_round

STYLE = {"accepted": "green", "resampled": "yellow", "bonus": "bold magenta"}


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


def _stream_coloured(console: Console, gen, tokenizer, prompt: str, params) -> None:
    """Print the prompt, then every emitted token in the colour of how it was produced."""
    console.print(Text(prompt, style="bold"), end="")
    tokens: list[int] = []
    shown = ""
    run = gen.stream([prompt], params)
    for event in run:
        (rec,) = event.records()
        for tok, how in zip(rec.emitted_token_ids, rec.how):
            tokens.append(tok)
            text = tokenizer.decode(tokens)
            if text.endswith("\ufffd") or not text.startswith(shown):
                continue  # an incomplete UTF-8 character: wait for the rest
            console.print(Text(text[len(shown) :], style=STYLE[how]), end="")
            shown = text
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
    from .engine import SpeculativeGenerator
    from .models import load, models_dir
    from .sampling import SamplingParams

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
