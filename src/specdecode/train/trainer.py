"""`specdecode train`: one tokenizer, one token stream, every model of a family trained on
the same batches for the same number of steps (AdamW, warmup + cosine, gradient clipping).

Each model's checkpoint is its lowest held-out loss so far (the small corpora here are
memorised if trained too long: stop near the held-out minimum). Resumable from
OUT/.train/state.pt; deterministic for a seed (batches are a function of seed and step).
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import SpecDecodeError
from .data import EOS, batch_at, encode_stream, eval_windows, read_corpus, train_tokenizer
from .families import Family, ModelSpec, mlp_width


@dataclass
class TrainConfig:
    family: str
    corpus: str
    steps: int
    seq_len: int
    batch_size: int
    lr: float
    seed: int
    eval_every: int
    eval_windows: int = 64
    weight_decay: float = 0.1
    clip: float = 1.0
    early_exit_layer: int = 0  # > 0: the target also learns to predict from its first M layers
    early_exit_weight: float = 0.0
    models: list[str] = field(default_factory=list)  # train only these models (default: all)


@dataclass
class ModelLog:
    name: str
    params: int
    best_val_loss: float = float("inf")
    best_step: int = 0
    train_loss: float = float("nan")
    train_seconds: float = 0.0
    history: list[tuple[int, float, float]] = field(default_factory=list)  # (step, train, val)


def _hf_config(spec: ModelSpec, vocab: int, eos_id: int, seq_len: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=spec.dim,
        intermediate_size=mlp_width(spec.dim),
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=max(4096, seq_len),
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=None,
        initializer_range=0.02,
    )


LR_BASE_DIM = 64


def peak_lr(cfg: TrainConfig, dim: int) -> float:
    """--lr is the peak for a dim-64 model; wider models get lr * sqrt(64 / dim) (a wide
    target at the narrow drafts' rate learned slower than they did)."""
    return cfg.lr * math.sqrt(LR_BASE_DIM / dim)


def _scale_residual_init(model, layers: int) -> None:
    """GPT-2's init: the projections that write into the residual stream (o_proj, down_proj)
    start at std 0.02 / sqrt(2 * layers). With transformers' plain 0.02 everywhere, the dim-256
    target learned slower per step than its dim-128 draft (held-out 6.00 vs 5.95 at step 100,
    5.50 vs 5.34 at step 200); with this init it reached 5.60 at step 100."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(1 / math.sqrt(2 * layers))


def _lr_at(step: int, cfg: TrainConfig, peak: float) -> float:
    """Linear warmup over 5% of the steps, then cosine decay to 10% of the peak."""
    warmup = max(1, cfg.steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return 0.1 * peak + 0.45 * peak * (1 + math.cos(math.pi * progress))


def _optimizer(model, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


@torch.no_grad()
@torch.inference_mode()
def _val_loss(model, windows: np.ndarray, batch_size: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        b = torch.from_numpy(windows[i : i + batch_size])
        logits = model(input_ids=b[:, :-1], use_cache=False).logits
        total += F.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten(), reduction="sum").item()
        count += b[:, 1:].numel()
    model.train()
    return total / count


def _save_model(model, tok, out: Path, log: ModelLog, meta: dict) -> None:
    """A Hugging Face model directory in fp16 with tokenizer and training metadata."""
    from transformers import PreTrainedTokenizerFast

    from ..models.hf import quiet_transformers

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    half = type(model)(model.config)
    half.load_state_dict(model.state_dict())
    half = half.to(torch.float16)
    with quiet_transformers():
        half.save_pretrained(str(tmp))  # a HybridLM writes our own hybrid layout
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(str(tmp))
    (tmp / "training.json").write_text(json.dumps(meta | {"model": asdict(log)}, indent=1) + "\n")
    if out.exists():
        card = out / "MODEL_CARD.md"
        if card.exists():
            shutil.copy(card, tmp / "MODEL_CARD.md")
        shutil.rmtree(out)
    tmp.rename(out)


def _settings(
    family: Family, corpus, out: Path, resume: bool, only: tuple[str, ...], **kw
) -> tuple[TrainConfig, list[ModelSpec]]:
    """The run's TrainConfig and the models it trains, every flag checked (one-line errors)."""
    steps, seq_len, batch_size, lr = kw["steps"], kw["seq_len"], kw["batch_size"], kw["lr"]
    eval_every, early_exit_layer = kw["eval_every"], kw["early_exit_layer"]
    early_exit_weight = kw["early_exit_weight"]
    for name, v in (("--steps", steps), ("--seq-len", seq_len), ("--batch-size", batch_size)):
        if v < 1:
            raise SpecDecodeError(f"{name} must be >= 1, got {v}")
    if eval_every is not None and eval_every < 1:
        raise SpecDecodeError(f"--eval-every must be >= 1, got {eval_every}")
    if not lr > 0:
        raise SpecDecodeError(f"--lr must be > 0, got {lr}")
    unknown = [m for m in only if m not in {spec.name for spec in family.models}]
    if unknown:
        raise SpecDecodeError(
            f"--models {','.join(unknown)}: not in {family.name} ({', '.join(m.name for m in family.models)})"
        )
    if early_exit_layer and not 1 <= early_exit_layer < family.target.layers:
        raise SpecDecodeError(
            f"--early-exit-layer must be in 1..{family.target.layers - 1} "
            f"for the {family.target.layers}-layer target"
        )
    if early_exit_weight < 0:
        raise SpecDecodeError(f"--early-exit-weight must be >= 0, got {early_exit_weight}")
    state_dir = out / ".train"
    if resume and not (state_dir / "state.pt").exists():
        raise SpecDecodeError(f"--resume: no training state in {state_dir}; start without --resume")
    if not resume and (state_dir / "state.pt").exists():
        raise SpecDecodeError(
            f"{out} holds an unfinished run; pass --resume to continue it or remove {state_dir}"
        )
    cfg = TrainConfig(
        family.name,
        str(corpus),
        steps,
        seq_len,
        batch_size,
        lr,
        kw["seed"],
        eval_every or max(10, steps // 12),
        early_exit_layer=early_exit_layer,
        early_exit_weight=early_exit_weight,
        models=list(only),
    )
    return cfg, [m for m in family.models if (m.name in only if only else m.default)]


def _corpus(family: Family, corpus, cfg: TrainConfig, state_dir: Path, resume: bool):
    """(tokenizer, train ids, held-out ids, corpus metadata): trained and saved in state_dir at
    the start of a run, read back from it on --resume (with the settings checked unchanged)."""
    from tokenizers import Tokenizer

    if resume:
        saved = json.loads((state_dir / "config.json").read_text())
        mismatch = {
            k: (v, getattr(cfg, k)) for k, v in saved.items() if k not in ("steps",) and getattr(cfg, k) != v
        }
        if mismatch:
            raise SpecDecodeError(f"--resume with different settings {mismatch}; use the original ones")
        tok = Tokenizer.from_file(str(state_dir / "tokenizer.json"))
        meta = json.loads((state_dir / "corpus.json").read_text())
        return tok, np.load(state_dir / "train.npy"), np.load(state_dir / "valid.npy"), meta
    text = read_corpus(corpus, family.file_glob)
    tok = train_tokenizer(text.train, family.vocab)
    train_ids, val_ids = encode_stream(tok, text.train), encode_stream(tok, text.valid)
    tok.save(str(state_dir / "tokenizer.json"))
    np.save(state_dir / "train.npy", train_ids)
    np.save(state_dir / "valid.npy", val_ids)
    meta = {
        "corpus": text.source,
        "files": text.files,
        "characters": text.chars,
        "train_tokens": int(len(train_ids)),
        "valid_tokens": int(len(val_ids)),
        "tokenizer_vocab": tok.get_vocab_size(),
        "python": platform.python_version(),
    }
    (state_dir / "corpus.json").write_text(json.dumps(meta, indent=1) + "\n")
    (state_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=1) + "\n")
    return tok, train_ids, val_ids, meta


def _new_model(spec: ModelSpec, family: Family, eos_id: int, seq_len: int, seed: int):
    """A freshly initialised model of `spec` (seeded): a Llama, or a hybrid with linear-attention layers."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    if spec.linear_layers:
        from .hybrid import HybridLM, hybrid_config

        dims = (spec.dim, spec.layers, spec.heads, mlp_width(spec.dim), spec.linear_layers)
        model = HybridLM(hybrid_config(family.vocab, *dims, eos_id)).float().train()
    else:
        model = LlamaForCausalLM(_hf_config(spec, family.vocab, eos_id, seq_len)).float().train()
    _scale_residual_init(model, spec.layers)
    return model


def _step(model, opt, x: torch.Tensor, y: torch.Tensor, lr: float, cfg: TrainConfig, exit_aux: bool) -> float:
    """One optimiser step of one model on a batch; returns its loss."""
    for g in opt.param_groups:
        g["lr"] = lr
    res = model(input_ids=x, use_cache=False, output_hidden_states=exit_aux)
    loss = F.cross_entropy(res.logits.flatten(0, 1), y.flatten())
    if exit_aux:  # LayerSkip-style: the first M layers + final norm + LM head also predict
        h = model.model.norm(res.hidden_states[cfg.early_exit_layer])
        loss = loss + cfg.early_exit_weight * F.cross_entropy(model.lm_head(h).flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
    opt.step()
    return loss.item()


def train_family(
    family: Family,
    corpus: str | Path,
    out: str | Path,
    *,
    steps: int,
    seq_len: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    resume: bool = False,
    eval_every: int | None = None,
    progress: bool = True,
    early_exit_layer: int = 0,
    early_exit_weight: float = 0.0,
    only: tuple[str, ...] = (),
) -> dict:
    """Train every model of `family`; write OUT/<model>/ directories. Returns the metadata."""
    out = Path(out)
    flags = dict(steps=steps, seq_len=seq_len, batch_size=batch_size, lr=lr, seed=seed, eval_every=eval_every)
    flags.update(early_exit_layer=early_exit_layer, early_exit_weight=early_exit_weight)
    cfg, specs = _settings(family, corpus, out, resume, only, **flags)
    state_dir = out / ".train"
    state_path = state_dir / "state.pt"
    state_dir.mkdir(parents=True, exist_ok=True)
    tok, train_ids, val_ids, corpus_meta = _corpus(family, corpus, cfg, state_dir, resume)
    eos_id = tok.token_to_id(EOS)
    windows = eval_windows(val_ids, seq_len, cfg.eval_windows)
    models = [_new_model(spec, family, eos_id, seq_len, seed) for spec in specs]
    opts = [_optimizer(model, cfg) for model in models]
    logs = [ModelLog(spec.name, sum(p.numel() for p in m.parameters())) for spec, m in zip(specs, models)]
    start = 0
    if resume:
        st = torch.load(state_path, weights_only=False)
        start = st["step"]
        for m, o, s_m, s_o in zip(models, opts, st["models"], st["opts"]):
            m.load_state_dict(s_m)
            o.load_state_dict(s_o)
        logs = [ModelLog(**d) for d in st["logs"]]

    def meta_for(spec: ModelSpec) -> dict:
        return {
            "family": family.name,
            "role": "target" if spec is family.target or spec.linear_layers else "draft",
            "architecture": "hybrid" if spec.linear_layers else "llama",
            "target": family.target.name,
            "peak_lr": peak_lr(cfg, spec.dim),
            "config": asdict(cfg),
            "corpus": corpus_meta,
            "tokens_seen": cfg.steps * batch_size * seq_len,
            "torch": torch.__version__,
        }

    def checkpoint(step: int) -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save(
            {
                "step": step,
                "models": [m.state_dict() for m in models],
                "opts": [o.state_dict() for o in opts],
                "logs": [asdict(x) for x in logs],
            },
            tmp,
        )
        os.replace(tmp, state_path)

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = [
        TextColumn("[bold]{task.fields[family]}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    t_start = time.perf_counter()
    tokens_per_step = batch_size * seq_len
    with Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task("train", total=steps, completed=start, family=family.name, info="")
        for step in range(start, steps):
            batch = torch.from_numpy(batch_at(train_ids, step, seed, batch_size, seq_len))
            x, y = batch[:, :-1], batch[:, 1:]
            for model, opt, log, spec in zip(models, opts, logs, specs):
                t0 = time.perf_counter()
                exit_aux = bool(cfg.early_exit_layer) and spec is family.target
                lr_now = _lr_at(step, cfg, peak_lr(cfg, spec.dim))
                log.train_loss = _step(model, opt, x, y, lr_now, cfg, exit_aux)
                log.train_seconds += time.perf_counter() - t0
            done = step + 1
            if done % cfg.eval_every == 0 or done == steps:
                for model, log, spec in zip(models, logs, specs):
                    val = _val_loss(model, windows, batch_size)
                    log.history.append((done, log.train_loss, val))
                    if val < log.best_val_loss:
                        log.best_val_loss, log.best_step = val, done
                        _save_model(model, tok, out / spec.name, log, meta_for(spec))
                checkpoint(done)
                if not progress:
                    vals = " ".join(f"{lg.name} {lg.history[-1][2]:.4f}" for lg in logs)
                    print(
                        f"step {done}/{steps} held-out loss: {vals} ({time.perf_counter() - t_start:.0f} s)",
                        flush=True,
                    )
            elapsed = time.perf_counter() - t_start
            rate = (done - start) * tokens_per_step / max(elapsed, 1e-9)
            info = " ".join(f"{lg.name} {lg.train_loss:.2f}" for lg in logs)
            best = " ".join(f"{lg.best_val_loss:.2f}" for lg in logs if lg.history)
            bar.update(task, completed=done, info=f"loss {info} | val {best or '-'} | {rate:,.0f} tok/s")
    # final metadata (best checkpoints are already on disk)
    for spec, log in zip(specs, logs):
        path = out / spec.name / "training.json"
        if path.exists():
            data = json.loads(path.read_text())
            data["model"] = asdict(log)
            path.write_text(json.dumps(data, indent=1) + "\n")
    shutil.rmtree(state_dir)
    return {"family": family.name, "models": [asdict(x) for x in logs], "corpus": corpus_meta}
