"""What a smaller draft head (FR-Spec) buys on the real pair: the 0.5B draft with its head over the
N most frequent tokens of a ranked list (`specdecode draft-vocab`), against its whole head, on
held-out prompts (the demo's code chats, HumanEval, Spec-Bench; the shipped list was built from
data/distill-prompts.jsonl), greedy, batch 1, the formats the library picks, interleaved.

    .venv/bin/python benchmarks/draft_vocab.py --list FILE.json --sizes 8192,16384,32768,full

Per size: tokens/s, tau (tokens per target forward), the draft's seconds per round and per draft
forward, c (a draft forward over a target forward), the share of the target's tokens that the list
holds, and whether every output equals the whole head's (it must: the target verifies).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", required=True, help="a ranked JSON list of token ids")
    ap.add_argument("--sizes", default="16384,32768,full", help="comma-separated N (or full)")
    ap.add_argument("--limit", type=int, default=2, help="prompts of each set (default 2)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", help="write the table (markdown) here too")
    args = ap.parse_args()

    import torch
    from peers import prompts

    from specdecode import SamplingParams, SpeculativeGenerator
    from specdecode.demo import PAIR_DRAFT, PAIR_TARGET
    from specdecode.opener import open_models

    torch.set_num_threads(2)
    ranked = json.loads(Path(args.list).read_text())
    loaded = open_models(PAIR_TARGET, draft=PAIR_DRAFT, k=args.k, draft_vocab="full")
    target, draft, inv = loaded.target, loaded.draft, loaded.config.batch_invariant
    tmp = Path(tempfile.mkdtemp())
    gens = {}
    for size in args.sizes.split(","):
        vocab = None
        if size != "full":
            vocab = tmp / f"top{size}.json"
            vocab.write_text(json.dumps(ranked[: int(size)]))
        gens[size] = SpeculativeGenerator(
            target,
            draft=draft,
            k=args.k,
            batch_invariant=inv,
            draft_vocab=None if vocab is None else str(vocab),
        )
    solo = SpeculativeGenerator(target, batch_invariant=inv)
    tok = target.tokenizer
    work = prompts(args.limit)
    params = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    ids = [
        tok.encode_chat([{"role": "user", "content": w["text"]}]) if w["chat"] else tok.encode(w["text"])
        for w in work
    ]
    for g in [*gens.values(), solo]:  # warm-up
        g.generate([ids[0][:32]], SamplingParams(temperature=0, max_new_tokens=8))
    rows = {name: [] for name in [*gens, "target-only"]}
    names = list(rows)
    for i, p in enumerate(ids):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            g = solo if name == "target-only" else gens[name]
            (r,) = g.generate([p], params)
            rows[name].append((work[i]["set"], r))
            print(
                f"{work[i]['set']:<18} {name:<12} {r.stats.new_tokens / r.stats.wall_s:6.2f} tok/s",
                file=sys.stderr,
            )
    solo_s = sum(r.stats.wall_s for _, r in rows["target-only"]) / sum(
        r.stats.target_forwards for _, r in rows["target-only"]
    )
    want = [list(r.token_ids) for _, r in rows["target-only"]]
    emitted = [t for w in want for t in w]
    lines = [
        f"# Draft head size on {PAIR_TARGET} ({loaded.choice.target}) + "
        f"{PAIR_DRAFT} ({loaded.choice.draft}), "
        f"k = {args.k}, greedy, {args.max_new_tokens} tokens, {len(ids)} held-out prompts, 2 threads",
        "",
        "| draft head | tok/s | tau | draft ms / round | ms / draft forward | c "
        "| list holds target's tokens | same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for name in gens:
        rs = [r for _, r in rows[name]]
        st = lambda f, rs=rs: sum(getattr(r.stats, f) for r in rs)
        rounds = st("rounds")
        forwards = rounds * args.k - rounds  # k - 1 one-token steps + the catch-up per round
        per_fwd = st("draft_s") / max(rounds + forwards, 1)
        keep = set(ranked[: int(name)]) if name != "full" else None
        held = 1.0 if keep is None else sum(t in keep for t in emitted) / len(emitted)
        same = sum(list(r.token_ids) == w for r, w in zip(rs, want))
        summary[name] = {
            "tok_s": st("new_tokens") / st("wall_s"),
            "tau": st("new_tokens") / st("target_forwards"),
            "draft_ms_round": 1e3 * st("draft_s") / rounds,
            "draft_ms_forward": 1e3 * per_fwd,
            "c": per_fwd / solo_s,
            "held": held,
            "same": f"{same}/{len(rs)}",
        }
        s = summary[name]
        lines.append(
            f"| {name} | {s['tok_s']:.2f} | {s['tau']:.2f} | {s['draft_ms_round']:.1f} | "
            f"{s['draft_ms_forward']:.1f} | {s['c']:.3f} | {s['held']:.2%} | {s['same']} |"
        )
    solo_rate = statistics.fmean([r.stats.new_tokens / r.stats.wall_s for _, r in rows["target-only"]])
    lines += ["", f"target-only: {solo_rate:.2f} tok/s, {1e3 * solo_s:.1f} ms a forward (c's unit)."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
