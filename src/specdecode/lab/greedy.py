"""Experiment 3: at temperature 0 speculative decoding emits exactly the target's greedy tokens."""

from __future__ import annotations

from ..core.sampling import SamplingParams
from ..engine import SpeculativeGenerator
from .common import LabConfig, LabResult, Table, label, new_figure, plot_label


def run(cfg: LabConfig, ks: tuple[int, ...] = (2, 4), new_tokens: int | None = None) -> LabResult:
    cfg.check_pairs()
    n = new_tokens or (24 if cfg.quick else 48)
    params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    target = cfg.model(cfg.target)
    plain = SpeculativeGenerator(target)
    reference = {p: plain.generate([p], params)[0].token_ids for p in cfg.prompts}
    cells, rows = [], []
    jobs = [(p, d, k) for p in cfg.prompts for d in cfg.drafts for k in ks]
    for prompt, d, k in cfg.track(jobs, "greedy: decoding", total=len(jobs)):
        (res,) = SpeculativeGenerator(target, draft=cfg.model(d), k=k).generate([prompt], params)
        ref = reference[prompt]
        same = res.token_ids == ref
        mismatch = next((i for i, (a, b) in enumerate(zip(res.token_ids, ref)) if a != b), None)
        cell = {
            "prompt": prompt,
            "draft": label(d),
            "k": k,
            "identical": same,
            "tokens": len(res.token_ids),
            "tokens_per_forward": res.stats.tokens_per_forward,
            "acceptance_rate": res.stats.acceptance_rate,
            "first_mismatch": mismatch,
            "text": res.text,
        }
        cells.append(cell)
        rows.append(
            [
                prompt,
                label(d),
                k,
                same,
                len(res.token_ids),
                res.stats.tokens_per_forward,
                res.stats.acceptance_rate,
            ]
        )
    same = sum(c["identical"] for c in cells)
    return LabResult(
        "greedy",
        "3. greedy: speculative output is the target's greedy output, token for token",
        "With temperature 0 the target's next token is its argmax, and verification keeps a draft "
        "token only if it equals that argmax; at the first mismatch it emits the argmax itself. So "
        "every prompt, draft and k must give the same tokens as the target decoding alone, whatever "
        "the draft proposes; only the number of target forwards changes (tokens/forward column).",
        "lesson 000: speculative == target greedy in 16 / 16 cases (4 prompts × 2 drafts × k ∈ {2, 4}).",
        [
            Table(
                f"greedy decoding, {n} new tokens: {same} / {len(cells)} identical to the target alone",
                ["prompt", "draft", "k", "identical", "tokens", "tokens/forward", "α"],
                rows,
            )
        ],
        {
            "identical": same,
            "cells_total": len(cells),
            "new_tokens": n,
            "cells": cells,
            "reference_token_ids": reference,
        },
        {"all_identical": same == len(cells)},
        _plot(cells),
    )


def _plot(cells: list[dict]):
    fig, ax = new_figure(figsize=(8, 3.6))
    prompts = list(dict.fromkeys(c["prompt"] for c in cells))
    colours = ["tab:green" if c["identical"] else "tab:red" for c in cells]
    ax.bar(range(len(cells)), [c["tokens_per_forward"] for c in cells], color=colours)
    names = [f"{plot_label(c['prompt'], prompts.index(c['prompt']))}\n{c['draft']} k={c['k']}" for c in cells]
    ax.set_xticks(range(len(cells)), names, fontsize=6, rotation=90)
    ax.set_ylabel("tokens per target forward")
    ax.set_title("greedy: every bar green = identical to the target's own greedy tokens")
    return fig
