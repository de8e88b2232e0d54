"""Experiment 8: run every experiment and write one self-contained HTML report (plots embedded)
and report.json with every figure."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

from jinja2 import Environment

from ..errors import SpecDecodeError
from . import EXPERIMENTS, run_experiment
from .common import LabConfig, LabResult, Table

TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>specdecode lab report</title>
<style>
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.6em 0 1.2em; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
caption { text-align: left; font-weight: 600; padding: 4px 0; }
.note, .ref { color: #555; font-size: 0.88em; } .ref { border-left: 3px solid #c9a; padding-left: 0.6em; }
.ok { color: #080; font-weight: 600; } .bad { color: #b00; font-weight: 600; }
img { max-width: 100%; } section { border-top: 1px solid #ddd; margin-top: 2em; }
</style></head><body>
<h1>specdecode lab report</h1>
<p>Every experiment of the two source lessons, rerun on our models ({{ models }}). Generated {{ when }} in
{{ "%.0f" | format(seconds) }} s{% if quick %} with <code>--quick</code> (fewer draws and runs){% endif %}.
Each section says what the experiment shows and how to read it; the lessons' own figures are quoted
beside ours.</p>
{{ table(summary) }}
{% for r in results %}
<section id="{{ r.name }}"><h2>{{ r.title }}</h2>
<p>{{ r.about }}</p>
<p class="ref">Lessons: {{ r.reference }}</p>
{% for t in r.tables %}{{ table(t) }}{% endfor %}
{% if r.png %}<img alt="{{ r.name }} plot" src="data:image/png;base64,{{ r.png }}">{% endif %}
{% if r.checks %}<p>Checks: {% for name, ok in r.checks.items() %}<code>{{ name }}</code>
<span class="{{ 'ok' if ok else 'bad' }}">{{ 'holds' if ok else 'FAILS' }}</span>{{ '; ' if not loop.last }}
{% endfor %}</p>{% endif %}
<p class="note">{{ "%.1f" | format(r.seconds) }} s</p></section>
{% endfor %}
</body></html>
"""

TABLE = """<table><caption>{{ t.title }}</caption>
<tr>{% for c in t.columns %}<th>{{ c }}</th>{% endfor %}</tr>
{% for row in t.rows %}<tr>{% for v in row %}<td>{{ fmt(v) }}</td>{% endfor %}</tr>{% endfor %}</table>
{% if t.note %}<p class="note">{{ t.note }}</p>{% endif %}"""


def _get(results: dict[str, LabResult], name: str):
    r = results.get(name)
    return r.data if r is not None else None


def summary_table(results: dict[str, LabResult]) -> Table:
    """The main table: each headline figure of the lessons beside ours."""
    rows = []
    if (d := _get(results, "roofline")) and "H100 SXM" in d["hardware"]:
        h = d["hardware"]["H100 SXM"]
        k1 = d["k"] + 1
        rows.append(
            [
                "roofline",
                "H100 SXM ms/token: weight read / compute / compute at 5 positions",
                "15.30 / 0.052 / 0.26",
                f"{h['weight_read_ms_1']:.2f} / {h['compute_ms_1']:.3f} / {h[f'compute_ms_{k1}']:.2f}",
            ]
        )
    if d := _get(results, "rules"):
        c = d["first"]
        rows += [
            ["rules", "(a) accept only if equal: acceptance", "0.73%", f"{100 * c['match_measured']:.2f}%"],
            [
                "rules",
                "(b) resample from p: TV (theory)",
                "0.1666 (0.165906)",
                f"{c['resample_p_tv']:.4f} ({c['resample_p_tv_theory']:.6f})",
            ],
            [
                "rules",
                "(c) residual: TV vs noise (mean / p99)",
                "0.0218 vs 0.0215",
                f"{c['residual_tv']:.4f} vs {c['noise_tv_mean']:.4f} / {c['noise_tv_p99']:.4f}",
            ],
            [
                "rules",
                "α = 1 − TV(p, q), drafts at 孔明曰：「",
                "56.7% / 56.5%",
                " / ".join(
                    f"{100 * x['alpha']:.1f}% ({x['draft']})"
                    for x in d["cases"]
                    if x["prompt"] == c["prompt"]
                ),
            ],
        ]
    if d := _get(results, "greedy"):
        rows.append(
            ["greedy", "speculative == target greedy", "16 / 16", f"{d['identical']} / {d['cells_total']}"]
        )
    if d := _get(results, "replay"):
        rows.append(
            [
                "replay",
                "one traced run (k = 4, T = 1): rounds → tokens",
                "15 → 33",
                f"{d['rounds']} → {d['tokens']}",
            ]
        )
    if d := _get(results, "formula"):
        rows.append(
            [
                "formula",
                "tokens/forward measured vs formula (small / large draft)",
                "1.96 vs 1.95 / 2.40 vs 2.40",
                " / ".join(f"{p['tokens_per_forward']:.2f} vs {p['formula']:.2f}" for p in d["pairs"]),
            ]
        )
        spread = " / ".join(f"{100 * min(a):.0f}%..{100 * max(a):.0f}%" for a in d["positions"].values())
        rows.append(["formula", "per-position α over 64 positions", "30%..96%", spread])
    if d := _get(results, "speedup"):
        rows.append(
            [
                "speedup",
                "best k and predicted speed-up (c = parameter ratio)",
                "small k=3 1.50x; large k=8 0.75x",
                "; ".join(
                    f"{s['draft']} k={s['optimal_k_c_params']} {s['optimal_speedup_c_params']:.2f}x"
                    for s in d["summary"]
                ),
            ]
        )
        rows.append(
            [
                "speedup",
                "best measured on this CPU (c measured)",
                "",
                "; ".join(
                    f"{s['draft']} k={s['best_measured_k']} {s['best_measured_speedup']:.2f}x "
                    f"(c {s['c_measured']:.2f})"
                    for s in d["summary"]
                ),
            ]
        )
    if d := _get(results, "lesson2"):
        h = d["homework2"]
        rows.append(
            [
                "lesson2",
                "tokens per round, K = 5, α = 0.8",
                "4.096 (homework)",
                f"{h['measured']:.3f} measured, {h['right_formula']:.3f} formula",
            ]
        )
    if d := _get(results, "plan"):
        best = {p["batch"]: p["speedup"] for p in d["best"]}
        pub = d["published_eagle3_sglang_h100"]
        rows.append(
            [
                "plan",
                "EAGLE-3 speed-up by batch 2 / 16 / 64 (H100)",
                " / ".join(f"{v:.2f}x" for v in pub.values()) + " (published)",
                " / ".join(f"{best.get(b, float('nan')):.2f}x" for b in pub) + " (roofline, best k)",
            ]
        )
    return Table(
        "main results: the lessons' figures and ours", ["experiment", "quantity", "lessons", "ours"], rows
    )


def _fmt(v) -> str:
    from .common import _fmt as f

    return f(v)


def write_report(
    cfg: LabConfig, out: str | Path, only: tuple[str, ...] = EXPERIMENTS, with_plan: bool = True
) -> tuple[Path, Path, dict[str, LabResult]]:
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecDecodeError(f"cannot create --out directory {out}: {e.strerror}") from None
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    t0 = time.perf_counter()
    results: dict[str, LabResult] = {}
    inner = LabConfig(cfg.target, cfg.drafts, cfg.prompt, cfg.prompts, cfg.seed, cfg.quick, progress=False)
    names = [*only, *(["plan"] if with_plan else [])]
    with Progress(
        TextColumn("lab report: {task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not cfg.progress,
    ) as bar:
        task = bar.add_task(names[0], total=len(names))
        for name in names:
            bar.update(task, description=name)
            if name == "plan":
                from ..plan import run_plan

                s = time.perf_counter()
                results[name] = run_plan()
                results[name].seconds = time.perf_counter() - s
            else:
                results[name] = run_experiment(name, inner)
            bar.advance(task)
    seconds = time.perf_counter() - t0
    summary = summary_table(results)
    env = Environment(autoescape=True)
    env.globals["fmt"] = _fmt
    table_t = env.from_string(TABLE)
    env.globals["table"] = lambda t: table_t.render(t=t)
    views = []
    for r in results.values():
        png = r.png_bytes()
        views.append(
            {
                "name": r.name,
                "title": r.title,
                "about": r.about,
                "reference": r.reference,
                "tables": r.tables,
                "checks": r.checks,
                "seconds": r.seconds,
                "png": base64.b64encode(png).decode() if png else None,
            }
        )
    html = env.from_string(TEMPLATE).render(
        results=views,
        summary=summary,
        seconds=seconds,
        quick=cfg.quick,
        when=time.strftime("%Y-%m-%d %H:%M"),
        models=", ".join([cfg.target, *cfg.drafts]),
    )
    html_path, json_path = out / "report.html", out / "report.json"
    html_path.write_text(html, encoding="utf-8")
    doc = {
        "seconds": seconds,
        "quick": cfg.quick,
        "summary": summary.to_dict(),
        "experiments": {n: r.to_json() for n, r in results.items()},
    }
    json_path.write_text(json.dumps(doc, ensure_ascii=False, indent=1, default=float), encoding="utf-8")
    return html_path, json_path, results
