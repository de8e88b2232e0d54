"""The benchmark's markdown table and plot."""

from __future__ import annotations

from pathlib import Path


def _f(v, fmt: str = "{:.2f}") -> str:
    return "–" if v is None else fmt.format(v)


def markdown(results: dict) -> str:
    cfg, m = results["config"], results["machine"]
    lines = [
        "# specdecode bench",
        "",
        f"torch {m['torch']}, transformers {m['transformers']}, {m['threads']} threads, {m['cpu']}; "
        f"k = {cfg['k']}, {cfg['max_new_tokens']} new tokens per prompt, "
        f"{cfg['repeats']} interleaved repeats, "
        f"{cfg['prompts_per_set']} prompts per set; {results['seconds']:.0f} s in all.",
        "",
        "## Targets",
        "",
        "| target | goal | worst (where) | median | met |",
        "|---|---|---|---|---|",
    ]
    for t in results["targets"]:
        op = "≤" if "<=" in t["target"] else "≥"
        lines.append(
            f"| {t['target']} | {op} {t['goal']:g} | {t['worst']:.2f} ({t['worst_at']}) | "
            f"{t['median']:.2f} | "
            f"{'yes' if t['met'] else '**no**'} |"
        )
    for family, fam in results["families"].items():
        ratios = fam["verification_cost_ratio"]
        lines += [
            "",
            f"## {family} (target {fam['target']}, draft {fam['draft']})",
            "",
            "Verification cost T(n)/T(1), n tokens in one target forward: "
            + ", ".join(f"n={n}: {r:.2f}" for n, r in ratios.items())
            + f" (T(1) = {fam['forward_ms']['1']:.2f} ms).",
        ]
        keys = sorted({(r["prompt_set"], r["temperature"]) for r in fam["rows"]}, key=lambda x: (x[1], x[0]))
        for s, temp in keys:
            lines += [
                "",
                f"### {s} prompts, {'greedy' if temp == 0 else f'T = {temp:g}'}",
                "",
                "| configuration | tokens/s (min–max) | ms/token | tokens/forward | vs transformers generate "
                "| vs transformers assisted | vs ours target-only | α | mean k | c | Thm 3.8 predicted "
                "| efficiency | accounted |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in fam["rows"]:
                if (r["prompt_set"], r["temperature"]) != (s, temp):
                    continue
                lines.append(
                    f"| {r['config']} | {r['tokens_per_s']:.0f} ({r['tokens_per_s_min']:.0f}–"
                    f"{r['tokens_per_s_max']:.0f}) | {r['ms_per_token']:.2f} | "
                    f"{_f(r['tokens_per_forward'])} | "
                    f"{_f(r['speedup_vs_transformers_generate'], '{:.2f}x')} | "
                    f"{_f(r['speedup_vs_transformers_assisted'], '{:.2f}x')} | "
                    f"{_f(r['speedup_vs_ours_target_only'], '{:.2f}x')} | {_f(r['alpha'])} | "
                    f"{_f(r['mean_k'], '{:.1f}')} | {_f(r['cost_ratio'], '{:.3f}')} | "
                    f"{_f(r['predicted_speedup'], '{:.2f}x')} | {_f(r['engine_efficiency'])} | "
                    f"{_f(r['accounted_speedup'], '{:.2f}x')} |"
                )
    lines += [
        "",
        "Columns: tokens/s is the median over repeats of (tokens / seconds) over the set's prompts, "
        "min–max across repeats. tokens/forward counts the target forwards that produced tokens "
        "(transformers' counted with a forward hook). α = accepted / tested draft tokens; mean k = "
        "draft tokens per round; c = seconds per draft token / seconds per target forward of ours "
        "target-only in the same cell. Thm 3.8 predicted = (1 − α^(k+1)) / ((1 − α)(kc + 1)) at the mean "
        "k; efficiency = measured speed-up over ours target-only / predicted. accounted = measured "
        "tokens/forward / (k c + T(k+1)/T(1)): the speed-up the measured acceptance, draft cost and "
        "verification cost allow, with no other overhead.",
        "",
    ]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    from ..lab.common import new_figure

    fams = list(results["families"])
    temps = results["config"]["temperatures"]
    fig, axes = new_figure(
        len(fams), len(temps) + 1, figsize=(6 * (len(temps) + 1), 5 * len(fams)), squeeze=False
    )
    for i, family in enumerate(fams):
        fam = results["families"][family]
        sets = sorted({r["prompt_set"] for r in fam["rows"]})
        for j, temp in enumerate(temps):
            ax = axes[i][j]
            configs = list(dict.fromkeys(r["config"] for r in fam["rows"]))
            width = 0.8 / len(sets)
            for si, s in enumerate(sets):
                vals = {
                    r["config"]: r for r in fam["rows"] if r["prompt_set"] == s and r["temperature"] == temp
                }
                ys = [vals[c]["tokens_per_s"] for c in configs]
                lo = [vals[c]["tokens_per_s"] - vals[c]["tokens_per_s_min"] for c in configs]
                hi = [vals[c]["tokens_per_s_max"] - vals[c]["tokens_per_s"] for c in configs]
                ax.barh(
                    [y + si * width for y in range(len(configs))], ys, height=width, xerr=[lo, hi], label=s
                )
            ax.set_yticks([y + 0.4 - width / 2 for y in range(len(configs))])
            ax.set_yticklabels(configs, fontsize=7)
            ax.invert_yaxis()
            ax.set_xlabel("tokens/s (median, min–max)")
            ax.set_title(f"{family}, {'greedy' if temp == 0 else f'T = {temp:g}'}")
            ax.legend(fontsize=7)
        ax = axes[i][-1]
        ratios = fam["verification_cost_ratio"]
        ax.plot([int(n) - 1 for n in ratios], list(ratios.values()), marker="o", label="measured T(k+1)/T(1)")
        ax.axhline(1.0, color="gray", ls=":", label="ideal (free verification)")
        ax.axhline(1.3, color="red", ls="--", label="target at k = 4")
        ax.set_xlabel("draft tokens k (the forward verifies k + 1)")
        ax.set_ylabel("cost relative to one token")
        ax.set_title(f"{family}: verification cost")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
