"""Experiment 4: one real sampled run replayed round by round: what was drafted, how likely
each model found it, the uniform drawn, the verdict and how each emitted token was made."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.sampling import SamplingParams
from ..engine import SpeculativeGenerator
from ..engine.stats import RoundRecord
from ..errors import SpecDecodeError
from .common import LabConfig, LabResult, Table, label, new_figure

FIELDS = tuple(RoundRecord.__dataclass_fields__)


def read_trace(path: str | Path) -> list[dict]:
    """Rounds of row 0 from a --trace file written by `specdecode generate`."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise SpecDecodeError(f"cannot read --trace file {path}: {e.strerror}") from None
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise SpecDecodeError(
                f"{path}:{i} is not JSON; pass a file written by generate --trace"
            ) from None
        missing = [f for f in FIELDS if f not in rec]
        if missing:
            raise SpecDecodeError(f"{path}:{i} lacks {', '.join(missing)}; pass a generate --trace file")
        if rec["row"] == 0:
            records.append(rec)
    if not records:
        raise SpecDecodeError(f"{path} has no rounds; pass a file written by generate --trace")
    return records


def make_trace(cfg: LabConfig, k: int, new_tokens: int) -> list[dict]:
    gen = SpeculativeGenerator(cfg.model(cfg.target), draft=cfg.model(cfg.drafts[0]), k=k)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=cfg.seed, ignore_eos=True)
    return [r.to_dict() for ev in gen.stream([cfg.prompt], params) for r in ev.records()]


def run(cfg: LabConfig, trace: str | None = None, k: int = 4, new_tokens: int = 32) -> LabResult:
    records = read_trace(trace) if trace else make_trace(cfg, k, new_tokens)
    tok = cfg.model(cfg.target).tokenizer

    def show(ids: list[int]) -> str:
        return " ".join(repr(tok.decode([t]))[1:-1] or "·" for t in ids) if tok else str(ids)

    rows, rounds = [], []
    for rec in records:
        emitted = show(rec["emitted_token_ids"])
        how = " ".join({"accepted": "A", "resampled": "R", "bonus": "B"}[h] for h in rec["how"])
        for i, t in enumerate(rec["draft_token_ids"]):
            u = rec["uniform"][i]
            verdict = (
                "—"
                if u is None and not rec["accepted"][i]
                else ("accept" if rec["accepted"][i] else "reject")
            )
            rows.append(
                [
                    rec["round"] if i == 0 else "",
                    show([t]),
                    rec["draft_prob"][i],
                    rec["target_prob"][i],
                    rec["accept_prob"][i],
                    "—" if u is None else u,
                    verdict,
                    emitted if i == 0 else "",
                    how if i == 0 else "",
                ]
            )
        rounds.append(len(rec["emitted_token_ids"]))
    total = sum(rounds)
    k_used = len(records[0]["draft_token_ids"])
    text = tok.decode([t for r in records for t in r["emitted_token_ids"]]) if tok else ""
    checks = {
        "every_round_emits_1_to_k_plus_1": all(1 <= n <= k_used + 1 for n in rounds),
        "emitted_equals_accepted_plus_one": all(
            len(r["emitted_token_ids"]) == sum(r["accepted"]) + 1 for r in records[:-1]
        ),
    }
    return LabResult(
        "replay",
        "4. replay: one sampled run, round by round",
        "Each line is one target forward. The draft proposed k tokens with probabilities q; the target "
        "gave them p; a token is accepted when the uniform u < min(1, p/q), so any token the target "
        "likes at least as much as the draft (p ≥ q) is always kept. After the first rejection the "
        "round emits one token from the residual (R); if all k pass it emits a bonus token from the "
        "target (B). So a round emits between 1 and k + 1 tokens: never fewer than plain decoding.",
        "lesson 000: one traced run, k = 4, T = 1, prompt 孔明曰：「: 15 rounds gave 33 tokens.",
        [
            Table(
                f"{'trace ' + str(trace) if trace else label(cfg.target) + ' + ' + label(cfg.drafts[0])}, "
                f"k = {k_used}, T = 1, prompt {cfg.prompt!r}",
                [
                    "round",
                    "draft token",
                    "q(x)",
                    "p(x)",
                    "min(1,p/q)",
                    "uniform",
                    "verdict",
                    "emitted",
                    "how",
                ],
                rows,
                "one line per draft position; '—': never tested (after a rejection). how: A accepted draft, "
                "R resampled from the residual after a rejection, B bonus token. � is part of a character "
                "split across byte-level tokens.",
            ),
            Table(
                "totals",
                ["rounds", "tokens", "tokens per round"],
                [[len(records), total, total / len(records)]],
            ),
        ],
        {
            "rounds": len(records),
            "tokens": total,
            "tokens_per_round": total / len(records),
            "emitted_per_round": rounds,
            "text": text,
            "records": records,
        },
        checks,
        _plot(rounds, k_used),
    )


def _plot(rounds: list[int], k: int):
    fig, ax = new_figure(figsize=(7, 3))
    ax.bar(range(len(rounds)), rounds, color="tab:blue")
    ax.axhline(1, color="gray", ls=":", label="plain decoding (1 per forward)")
    ax.axhline(k + 1, color="tab:green", ls="--", label=f"k + 1 = {k + 1}")
    ax.set_xlabel("round")
    ax.set_ylabel("tokens emitted")
    ax.set_title("tokens per target forward, round by round")
    ax.legend(fontsize=8)
    return fig
