"""MODEL_CARD.md for every model of a trained family, written from training.json and from
measurements: a draft's acceptance against its target at T = 1 and T = 0, k = 4, on
held-out text."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import SpecDecodeError
from .data import read_corpus
from .families import FAMILIES, mlp_width


def peak_lr_for(config: dict, dim: int) -> float:
    from .trainer import LR_BASE_DIM

    return config["lr"] * (LR_BASE_DIM / dim) ** 0.5


def heldout_prompts(model_dir: Path, corpus: str | Path, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens, evenly spaced over the held-out split of the corpus."""
    from ..models.tokenizer import TextTokenizer

    meta = json.loads((model_dir / "training.json").read_text())
    family = FAMILIES[meta["family"]]
    text = read_corpus(corpus, family.file_glob)
    tok = TextTokenizer.from_dir(model_dir)
    ids = [t for doc in text.valid for t in tok.encode(doc)]
    if len(ids) < length + 1:
        raise SpecDecodeError(f"held-out text of {corpus} is too short for {length}-token prompts")
    starts = np.linspace(0, len(ids) - length - 1, n).astype(int)
    return [ids[s : s + length] for s in starts]


def measure_acceptance(
    target_dir: Path, draft_dir: Path, prompts: list[list[int]], new_tokens: int, k: int = 4, seed: int = 0
) -> dict:
    """Acceptance rate and tokens per target forward of draft against target, T = 1 and T = 0."""
    from ..core.sampling import SamplingParams
    from ..engine import SpeculativeGenerator
    from ..engine.stats import GenerationStats
    from ..models import load

    gen = SpeculativeGenerator(load(target_dir), draft=load(draft_dir), k=k)
    out = {}
    for name, temp in (("T=1", 1.0), ("T=0", 0.0)):
        params = SamplingParams(temperature=temp, max_new_tokens=new_tokens, seed=seed, ignore_eos=True)
        res = gen.generate(prompts, params)
        st = GenerationStats.merge([r.stats for r in res], max(r.stats.wall_s for r in res))
        out[name] = {
            "acceptance_rate": st.acceptance_rate,
            "draft_acceptance_rate": st.draft_acceptance_rate,
            "tokens_per_forward": st.tokens_per_forward,
            "per_position_acceptance": st.per_position_acceptance,
        }
    return out


def _architecture(cfg: dict, layers: int, dim: int) -> str:
    heads = cfg["num_attention_heads"]
    kinds = cfg.get("layer_types")
    if not kinds:
        shape = f"{layers} layers, dim {dim}, {heads} heads, MLP {mlp_width(dim)}"
        return f"| architecture | Llama, {shape}, tied embeddings |"
    linear = [i for i, t in enumerate(kinds) if t == "linear_attention"]
    return (
        f"| architecture | hybrid Llama: {layers} layers, dim {dim}, {heads} heads, MLP {mlp_width(dim)}, "
        f"tied embeddings; layers {', '.join(map(str, linear))} gated delta-rule linear attention, "
        "the others full attention |"
    )


def _card(model_dir: Path, meta: dict, cfg: dict, acceptance: dict | None, measured_on: str) -> str:
    m, c, corpus = meta["model"], meta["config"], meta["corpus"]
    dim, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    lines = [
        f"# {meta['family']}/{model_dir.name}",
        "",
        f"The {meta['role']} of the `{meta['family']}` family of specdecode, trained from scratch by "
        "`specdecode train` (this card is written by `specdecode model-card`).",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {m['params']:,} |",
        _architecture(cfg, layers, dim),
        f"| vocabulary | {cfg['vocab_size']:,} (byte-level BPE, `tokenizers`) |",
        f"| corpus | `{Path(corpus['corpus']).name}`: {corpus['files']:,} file(s), "
        f"{corpus['characters']:,} characters; {corpus['train_tokens']:,} training / "
        f"{corpus['valid_tokens']:,} held-out tokens (5%) |",
        f"| Python (corpus and training) | {corpus['python']} |",
        f"| steps | {c['steps']:,} (batch {c['batch_size']} x {c['seq_len']} tokens, AdamW, "
        f"peak lr {meta.get('peak_lr') or peak_lr_for(c, dim):.2g}, cosine, clip {c['clip']}, "
        f"weight decay {c['weight_decay']}, seed {c['seed']}) |",
        f"| tokens seen | {meta['tokens_seen']:,} |",
        f"| checkpoint | step {m['best_step']:,} (lowest held-out loss) |",
        f"| held-out loss | {m['best_val_loss']:.4f} |",
        f"| training loss at the end | {m['train_loss']:.4f} |",
        f"| training time | {m['train_seconds'] / 60:.1f} min (this model's share, 2-core CPU) |",
    ]
    if c.get("early_exit_layer") and meta["role"] == "target":
        lines.append(
            f"| early-exit training | its first {c['early_exit_layer']} layers + final norm + LM head also "
            f"predict the next token (loss weight {c['early_exit_weight']}; the training losses include "
            f"it), for `--method early-exit --exit-layer {c['early_exit_layer']}` |"
        )
    lines.append("")
    attention_target = model_dir.parent / meta["target"] / "training.json"
    if cfg.get("layer_types") and attention_target.exists():
        ref = json.loads(attention_target.read_text())["model"]
        lines += [
            "## Beside the attention-only target",
            "",
            f"Trained on the same corpus, tokenizer and batches as `{meta['family']}/{meta['target']}` "
            "(same seed, steps and schedule); held-out loss per token, lower is better:",
            "",
            "| model | parameters | held-out loss | at step |",
            "|---|---|---|---|",
            f"| {meta['target']} (attention only) | {ref['params']:,} | {ref['best_val_loss']:.4f} "
            f"| {ref['best_step']:,} |",
            f"| {model_dir.name} | {m['params']:,} | {m['best_val_loss']:.4f} | {m['best_step']:,} |",
            "",
        ]
    if acceptance:
        lines += [
            f"## Acceptance against `{meta['family']}/{meta['target']}` (k = 4)",
            "",
            f"Measured by speculative decoding with the engine on {measured_on}.",
            "",
            "α is the acceptance rate of the draft tokens the target checked (accepted / tested: "
            "Leviathan et al.'s α, the α of (1 − α^(k+1)) / (1 − α)); accepted / drafted also counts "
            "the drafts after a rejection, which are never checked.",
            "",
            "| temperature | acceptance rate α | accepted / drafted | tokens per target forward "
            "| per-position acceptance |",
            "|---|---|---|---|---|",
        ]
        for name, a in acceptance.items():
            pos = ", ".join(f"{x:.2f}" for x in a["per_position_acceptance"])
            lines.append(
                f"| {name[2:]} | {a['acceptance_rate']:.3f} | {a['draft_acceptance_rate']:.3f} "
                f"| {a['tokens_per_forward']:.2f} | {pos} |"
            )
        lines.append("")
    hist = m.get("history") or []
    if hist:
        lines += [
            "## Held-out loss during training",
            "",
            "| step | training loss | held-out loss |",
            "|---|---|---|",
        ]
        lines += [f"| {s} | {t:.4f} | {v:.4f} |" for s, t, v in hist]
        lines.append("")
    return "\n".join(lines)


def write_model_cards(
    family_dir: str | Path,
    corpus: str | Path | None = None,
    prompts: int = 8,
    prompt_tokens: int = 32,
    new_tokens: int = 64,
    only: tuple[str, ...] = (),
) -> list[Path]:
    """Write MODEL_CARD.md into every model directory of a trained family directory (only
    those named, when `only` is given)."""
    family_dir = Path(family_dir)
    dirs = sorted(p for p in family_dir.iterdir() if (p / "training.json").exists())
    if not dirs:
        raise SpecDecodeError(f"{family_dir} has no trained models (no */training.json)")
    metas = {d: json.loads((d / "training.json").read_text()) for d in dirs}
    # the family's target (a hybrid target is a target too, but the drafts were measured against this)
    target = next((d for d in dirs if metas[d]["role"] == "target" and d.name == metas[d]["target"]), None)
    corpus = corpus or metas[dirs[0]]["corpus"]["corpus"]
    if target is not None and not Path(corpus).exists():
        raise SpecDecodeError(f"corpus {corpus} not found; pass --corpus to measure acceptance")
    held = heldout_prompts(target, corpus, prompts, prompt_tokens) if target is not None else []
    measured_on = (
        f"{prompts} held-out prompts of {prompt_tokens} tokens, {new_tokens} new tokens each (seed 0, fp32)"
    )
    written = []
    for d in dirs:
        if only and d.name not in only:
            continue
        acc = None
        if metas[d]["role"] == "draft" and target is not None:
            acc = measure_acceptance(target, d, held, new_tokens)
            metas[d]["acceptance"] = acc
            (d / "training.json").write_text(json.dumps(metas[d], indent=1) + "\n")
        cfg = json.loads((d / "config.json").read_text())
        (d / "MODEL_CARD.md").write_text(_card(d, metas[d], cfg, acc, measured_on))
        written.append(d / "MODEL_CARD.md")
    return written


HEAD_TREES = ("4,2,1",)


def write_heads_card(
    heads_dir: str | Path,
    target: str | Path,
    corpus: str | Path,
    prompts: int = 8,
    prompt_tokens: int = 32,
    new_tokens: int = 64,
) -> Path:
    """MODEL_CARD.md for trained Medusa heads or an EAGLE drafter: training figures and tokens per
    target forward measured with the engine (chain k = 4 and a 4,2,1 tree; T = 1 and T = 0)."""
    from ..core.sampling import SamplingParams
    from ..engine import SpeculativeGenerator
    from ..engine.stats import GenerationStats
    from ..models import load, resolve

    heads_dir = Path(heads_dir)
    meta = json.loads((heads_dir / "config.json").read_text())
    method = meta["method"]
    target_dir = resolve(target)
    held = heldout_prompts(target_dir, corpus, prompts, prompt_tokens)
    model = load(target_dir)
    rows, measured = [], {}
    for shape in (None, *HEAD_TREES):
        gen = SpeculativeGenerator(model, k=4, method=method, heads=heads_dir, tree=shape)
        for name, temp in (("T=1", 1.0), ("T=0", 0.0)):
            params = SamplingParams(temperature=temp, max_new_tokens=new_tokens, seed=0, ignore_eos=True)
            res = gen.generate(held, params)
            st = GenerationStats.merge([r.stats for r in res], max(r.stats.wall_s for r in res))
            label = "chain, k = 4" if shape is None else f"tree {shape}"
            measured[f"{label} {name}"] = {
                "tokens_per_forward": st.tokens_per_forward,
                "acceptance_rate": st.acceptance_rate,
            }
            rows.append(f"| {label} | {name} | {st.tokens_per_forward:.2f} | {st.acceptance_rate:.3f} |")
    meta["measured"] = measured
    (heads_dir / "config.json").write_text(json.dumps(meta, indent=1) + "\n")
    what = (
        f"{meta['num_heads']} Medusa heads (residual block + the target's LM head)"
        if method == "medusa"
        else "an EAGLE drafter (one decoder layer over fused target features and token embeddings)"
    )
    top1 = meta.get("heldout_top1_per_head", meta.get("heldout_top1"))
    top1_text = " / ".join(f"{a:.3f}" for a in top1) if isinstance(top1, list) else f"{top1:.3f}"
    lines = [
        f"# {heads_dir.parent.name}/{heads_dir.name}",
        "",
        f"{what} for `{meta['target']}`, trained by `specdecode train-heads --method {method}` on the frozen "
        "target's features.",
        "",
        "| | |",
        "|---|---|",
        f"| parameters (without the shared LM head / embeddings) | {meta['params']:,} |",
        f"| steps × batch × length, lr | {meta['steps']} × {meta['batch_size']} × {meta['seq_len']}, "
        f"{meta['lr']} |",
        f"| training time | {meta['train_seconds']:.0f} s |",
        f"| held-out loss | {meta['heldout_loss']:.4f} |",
        f"| held-out top-1 accuracy{' per head' if method == 'medusa' else ''} | {top1_text} |",
        "",
        f"Measured with the engine on {prompts} held-out prompts of {prompt_tokens} tokens, "
        f"{new_tokens} new tokens each (seed 0, fp32):",
        "",
        "| drafting | decoding | tokens per target forward | acceptance (accepted / tested) |",
        "|---|---|---|---|",
        *rows,
        "",
        f"Use: `specdecode generate --target {meta['target']} --method {method} [--tree 4,2,1] --prompt ...`",
        "",
    ]
    card = heads_dir / "MODEL_CARD.md"
    card.write_text("\n".join(lines))
    return card


def write_eagle3_card(heads_dir: str | Path, benches: list[str | Path]) -> Path:
    """MODEL_CARD.md for an EAGLE-3 drafter: its training record (config.json's `specdecode`
    section, written by train-heads) and tau and speed-up per category from `specdecode bench
    --target ... --method eagle3 --json` runs (one per temperature)."""
    heads_dir = Path(heads_dir)
    cfg = json.loads((heads_dir / "config.json").read_text())
    meta = cfg["specdecode"]
    index = Path(meta["data"]) / "index.json"
    data = json.loads(index.read_text()) if index.exists() else {}
    rows = []
    for b in benches:
        res = json.loads(Path(b).read_text())
        c = res["config"]
        name = next(n for n in res["runners"] if n.startswith(f"ours {c['method']}"))
        shape = f"tree {c['tree']}" if c.get("tree") else f"chain k = {c['k']}"
        for cat, v in res["categories"].items():
            rows.append(
                f"| {cat} | {v['prompts']} | T = {c['temperature']:g} | {shape} | "
                f"{v['runners'][name]['tau']} | {v['speedup_vs_ours_target_only'][name]:.2f}x |"
            )
    steps = meta["heldout_top1_per_step"]
    lines = [
        f"# {heads_dir.parent.name}/{heads_dir.name}",
        "",
        f"An EAGLE-3 drafter for `{meta['target']}`: one decoder layer over the target's fused low, "
        f"middle and high features (layers {cfg['eagle_aux_hidden_state_layer_ids']}, vLLM's convention: "
        "the residual "
        f"stream entering each) and the next token's embedding, with a draft vocabulary of "
        f"{cfg['draft_vocab_size']:,} of the target's {cfg['vocab_size']:,} tokens (`d2t` maps them back). "
        "The checkpoint is the layout vLLM and SGLang load (`specdecode export`).",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| data | `specdecode distill-data`: the target's own answers to {data.get('prompts_file', '?')} "
        f"({len(data.get('sequences', []))} prompts, chat template {data.get('chat')}, temperatures "
        f"{data.get('temperatures')}, at most {data.get('max_new_tokens')} new tokens, "
        f"{data.get('dtype')}) |",
        f"| training sequences / tokens | {meta['train_sequences']:,} / {meta['train_tokens']:,} |",
        f"| draft vocabulary coverage of answer tokens | {meta['draft_vocab_coverage']:.1%} |",
        f"| training-time-test steps | {meta['ttt_steps']} |",
        f"| steps, batch tokens, lr | {meta['steps']}, {meta['batch_tokens']}, {meta['lr']} |",
        f"| training time (2 CPU cores) | {meta['train_seconds'] / 60:.1f} min |",
        "| held-out top-1 agreement with the target, per step | "
        + " / ".join(f"{a:.3f}" for a in steps)
        + " |",
        "",
        "## Measured (`specdecode bench --target ... --method eagle3 --chat`, Spec-Bench, batch 1)",
        "",
        "| category | prompts | decoding | drafting | τ (tokens per target forward) | speed-up |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Use: `specdecode generate --target {meta['target']} --method eagle3 --chat --prompt ...` (this "
        "drafter is found by the target's name); `--method auto` adds suffix matching. Speed-ups are over "
        "our target-only decoding in the same process.",
        "",
    ]
    card = heads_dir / "MODEL_CARD.md"
    card.write_text("\n".join(lines))
    return card
