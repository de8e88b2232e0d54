"""`specdecode train-heads`: draft heads trained on a frozen target's features.

Medusa: head i (0-based) reads the target's final hidden state at position t and is trained
with cross-entropy to predict token t + i + 2 through the target's own (frozen) LM head. The
residual blocks start at zero, so every head starts as the target's next-token prediction.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..drafters.medusa import MedusaHeads
from ..errors import SpecDecodeError
from .data import batch_at, encode_stream, eval_windows, read_corpus
from .families import FAMILIES


def _target_and_tokenizer(target_dir: Path):
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    from ..models.hf import quiet_transformers

    config = json.loads((target_dir / "config.json").read_text())
    if config.get("model_type") == "specdecode_hybrid":  # no transformers class: our own module
        from .hybrid import HybridLM

        model = HybridLM.from_pretrained(target_dir).eval()
    else:
        with quiet_transformers():
            model = LlamaForCausalLM.from_pretrained(
                str(target_dir), dtype=torch.float32, local_files_only=True
            ).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok_file = target_dir / "tokenizer.json"
    if not tok_file.exists():
        raise SpecDecodeError(f"{target_dir} has no tokenizer.json; heads are trained on text")
    return model, Tokenizer.from_file(str(tok_file))


def _setup(target, corpus, steps: int, batch_size: int, seq_len: int, min_seq: int, lr: float):
    """Check the settings, load the frozen target (transformers) and the token streams of the
    corpus split as the target's family was (95% train / 5% held out)."""
    from ..models import resolve

    for name, v in (("--steps", steps), ("--batch-size", batch_size)):
        if v < 1:
            raise SpecDecodeError(f"{name} must be >= 1, got {v}")
    if seq_len < min_seq:
        raise SpecDecodeError(f"--seq-len must be >= {min_seq}, got {seq_len}")
    if not lr > 0:
        raise SpecDecodeError(f"--lr must be > 0, got {lr}")
    target_dir = resolve(target)
    meta_file = target_dir / "training.json"
    family = json.loads(meta_file.read_text()).get("family") if meta_file.exists() else None
    glob = FAMILIES[family].file_glob if family in FAMILIES else "*.txt"
    model, tok = _target_and_tokenizer(target_dir)
    text = read_corpus(corpus, glob)
    return model, encode_stream(tok, text.train), encode_stream(tok, text.valid)


def _optimise(name, params, loss_fn, train_ids, *, steps, batch_size, seq_len, lr, seed, clip, progress):
    """AdamW over params for `steps` batches (5% warmup, cosine); loss_fn(ids) -> (loss, info).
    Returns the last training loss."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    loss_value = float("nan")
    columns = (TextColumn(name), BarColumn(), TextColumn("{task.completed}/{task.total} {task.fields[info]}"))
    with Progress(*columns, TimeElapsedColumn(), disable=not progress) as bar:
        task = bar.add_task(name, total=steps, info="")
        for step in range(steps):
            ids = torch.from_numpy(batch_at(train_ids, step, seed, batch_size, seq_len).astype(np.int64))
            frac = step / max(1, steps - 1)
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, (step + 1) / max(1, steps // 20)) * 0.5 * (1 + np.cos(np.pi * frac))
            loss, info = loss_fn(ids)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            loss_value = loss.item()
            bar.update(task, advance=1, info=f"loss {loss_value:.3f} top-1 {info}")
    return loss_value


def _heldout(val_ids, seq_len: int) -> torch.Tensor:
    return torch.from_numpy(eval_windows(val_ids, seq_len, 32).astype(np.int64))


def _medusa_loss(heads_w, heads_b, hidden, lm_head, ids) -> tuple[torch.Tensor, list[float]]:
    """Mean cross-entropy over heads; head i at position t predicts ids[t + i + 2]."""
    h, T = heads_w.shape[0], ids.shape[1]
    feats = hidden.unsqueeze(-2) + F.silu(torch.einsum("btd,hed->bthe", hidden, heads_w) + heads_b)
    losses, accs = [], []
    for i in range(h):
        n = T - i - 2
        logits = F.linear(feats[:, :n, i], lm_head)  # [B, n, V]
        target = ids[:, i + 2 :]
        losses.append(F.cross_entropy(logits.flatten(0, 1), target.flatten()))
        accs.append(float((logits.argmax(-1) == target).float().mean()))
    return torch.stack(losses).mean(), accs


def train_medusa(
    target: str | Path,
    corpus: str | Path,
    out: str | Path,
    *,
    num_heads: int = 4,
    steps: int = 400,
    batch_size: int = 16,
    seq_len: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    if num_heads < 1:
        raise SpecDecodeError(f"--heads must be >= 1, got {num_heads}")
    model, train_ids, val_ids = _setup(target, corpus, steps, batch_size, seq_len, num_heads + 3, lr)
    d = model.config.hidden_size
    torch.manual_seed(seed)
    heads_w = torch.zeros(num_heads, d, d, requires_grad=True)
    heads_b = torch.zeros(num_heads, d, requires_grad=True)
    lm_head = model.lm_head.weight

    def loss_fn(ids: torch.Tensor):
        with torch.no_grad():
            hidden = model.model(input_ids=ids).last_hidden_state  # final-normed [B, T, d]
        loss, accs = _medusa_loss(heads_w, heads_b, hidden, lm_head, ids)
        return loss, " ".join(f"{a:.2f}" for a in accs)

    t0 = time.perf_counter()
    loss_value = _optimise(
        "medusa heads",
        [heads_w, heads_b],
        loss_fn,
        train_ids,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
        seed=seed,
        clip=None,
        progress=progress,
    )
    windows = _heldout(val_ids, seq_len)
    with torch.no_grad():
        hidden = model.model(input_ids=windows).last_hidden_state
        val_loss, val_accs = _medusa_loss(heads_w, heads_b, hidden, lm_head, windows)
    meta = {
        "method": "medusa",
        "num_heads": num_heads,
        "hidden_size": d,
        "target": str(target),
        "corpus": str(corpus),
        "steps": steps,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "lr": lr,
        "seed": seed,
        "train_loss": loss_value,
        "heldout_loss": float(val_loss),
        "heldout_top1_per_head": val_accs,
        "train_seconds": time.perf_counter() - t0,
        "params": heads_w.numel() + heads_b.numel(),
    }
    MedusaHeads(heads_w.detach(), heads_b.detach()).save(Path(out), meta)
    return meta


def train_eagle(
    target: str | Path,
    corpus: str | Path,
    out: str | Path,
    *,
    steps: int = 400,
    batch_size: int = 16,
    seq_len: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
    cls_weight: float = 0.1,
) -> dict:
    """EAGLE: one Llama decoder layer over fc([embed(x_{j+1}), h_j]) regresses h_{j+1} (smooth L1)
    and, through the frozen LM head, predicts x_{j+2} (cross-entropy, weight cls_weight)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaModel as HFLlamaModel

    from ..drafters.eagle import KIND

    model, train_ids, val_ids = _setup(target, corpus, steps, batch_size, seq_len, 4, lr)
    tc = model.config
    d = tc.hidden_size
    torch.manual_seed(seed)
    layer_cfg = HFLlamaConfig(
        vocab_size=8,  # the layer's own embedding is never used: it reads fused features
        hidden_size=d,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings,
        rope_parameters=getattr(tc, "rope_parameters", None),
        tie_word_embeddings=False,
    )
    layer = HFLlamaModel(layer_cfg).float().train()
    fc = torch.nn.Linear(2 * d, d)
    params = [*layer.parameters(), *fc.parameters()]
    embed, lm_head = model.model.embed_tokens, model.lm_head.weight

    def losses(ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        with torch.no_grad():
            h = model.model(input_ids=ids).last_hidden_state  # [B, T, d]
            e = embed(ids[:, 1:])
        pred = layer(inputs_embeds=fc(torch.cat([e, h[:, :-1]], -1))).last_hidden_state  # ~ h[:, 1:]
        reg = F.smooth_l1_loss(pred, h[:, 1:])
        logits = F.linear(pred[:, :-1], lm_head)
        cls = F.cross_entropy(logits.flatten(0, 1), ids[:, 2:].flatten())
        acc = float((logits.argmax(-1) == ids[:, 2:]).float().mean())
        return reg + cls_weight * cls, acc

    def step_loss(ids: torch.Tensor):
        loss, acc = losses(ids)
        return loss, f"{acc:.2f}"

    t0 = time.perf_counter()
    loss_value = _optimise(
        "eagle drafter",
        params,
        step_loss,
        train_ids,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
        seed=seed,
        clip=1.0,
        progress=progress,
    )
    windows = _heldout(val_ids, seq_len)
    layer.eval()
    with torch.no_grad():
        val_loss, val_acc = losses(windows)
    weights = {
        k: v.detach().to(torch.float16).contiguous()
        for k, v in layer.state_dict().items()
        if not k.startswith("embed_tokens")
    }
    weights = {f"model.{k}": v for k, v in weights.items()}
    weights["fc.weight"] = fc.weight.detach().to(torch.float16).contiguous()
    weights["fc.bias"] = fc.bias.detach().to(torch.float16).contiguous()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "eagle.safetensors"), metadata={"format": "pt"})
    meta = {
        "kind": KIND,
        "method": "eagle",
        "target": str(target),
        "corpus": str(corpus),
        "steps": steps,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "lr": lr,
        "seed": seed,
        "train_loss": loss_value,
        "heldout_loss": float(val_loss),
        "heldout_top1": val_acc,
        "train_seconds": time.perf_counter() - t0,
        "params": sum(p.numel() for p in params) - layer.embed_tokens.weight.numel(),
        "layer_config": {**layer_cfg.to_dict(), "vocab_size": tc.vocab_size},
    }
    (out / "config.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta
