"""`specdecode train-heads --method eagle3`: an EAGLE-3 drafter trained on distilled data
(`specdecode distill-data`), never running the target.

The layer (drafters/eagle3.py) is trained with EAGLE-3's training-time test: step 0 reads the
target's fused features g_j and the next token; step s reads the layer's own output of step
s - 1 at the same index and the token s places further on, attending to the target-feature pairs
0..j and to its own earlier steps at index j (exactly the keys it sees when drafting s tokens
ahead). Step s at index j predicts token j + s + 2; the loss is the cross-entropy against the
target's own distribution there (from the stored final hidden state, restricted to the draft
vocabulary), weighted 0.8^s.

Draft vocabulary (FR-Spec): the N most frequent tokens of the distilled answers; the LM head
starts from the target's rows for them, the final norm from the target's, and `fc` so that the
fused feature starts as the target's high feature. Checkpoints every few minutes; a rerun with
the same --out resumes. The learning rate follows a cosine to the end of the step budget or of
--max-minutes, whichever comes first.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..drafters.eagle3 import ARCHITECTURE, KIND
from ..errors import SpecDecodeError
from .distill import DistillData

LOSS_DECAY = 0.8


def draft_vocabulary(data: DistillData, size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent answer tokens (ascending ids) and the share of answer tokens
    they cover."""
    counts = np.bincount(data.answer_tokens(), minlength=vocab_size)
    size = min(size, vocab_size)
    top = np.sort(np.argsort(-counts, kind="stable")[:size])
    coverage = float(counts[top].sum() / max(1, counts.sum()))
    return torch.from_numpy(top.astype(np.int64)), coverage


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


class Eagle3Trainer:
    """The layer's parameters (float32) and its training-time-test forward."""

    NAMES = {  # our parameter -> checkpoint name (vLLM / SGLang layout)
        "fc": "fc.weight",
        "in_norm": "midlayer.input_layernorm.weight",
        "hidden_norm": "midlayer.hidden_norm.weight",
        "q": "midlayer.self_attn.q_proj.weight",
        "k": "midlayer.self_attn.k_proj.weight",
        "v": "midlayer.self_attn.v_proj.weight",
        "o": "midlayer.self_attn.o_proj.weight",
        "post_norm": "midlayer.post_attention_layernorm.weight",
        "gate": "midlayer.mlp.gate_proj.weight",
        "up": "midlayer.mlp.up_proj.weight",
        "down": "midlayer.mlp.down_proj.weight",
        "norm": "norm.weight",
        "lm_head": "lm_head.weight",
    }

    def __init__(
        self,
        tcfg,
        embed: torch.Tensor,
        head: torch.Tensor,
        final_norm: torch.Tensor,
        draft_ids: torch.Tensor,
        seed: int = 0,
        feature_rms: float = 1.0,
        init_layer: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.cfg = tcfg
        d, inter, H, Hkv, D = (
            tcfg.hidden_size,
            tcfg.intermediate_size,
            tcfg.num_heads,
            tcfg.num_kv_heads,
            tcfg.head_dim,
        )
        g = torch.Generator().manual_seed(seed)

        def rand(*shape, std=0.02):
            return torch.randn(*shape, generator=g) * std

        # the fused feature starts as the target's high feature scaled to unit RMS: the target's
        # residual stream is large (RMS ~75 on SmolLM2, outlier channels ~24,000), and a layer
        # whose updates are O(1) beside it could hardly move its prediction
        fc = torch.zeros(d, 3 * d)
        fc[:, 2 * d :] = torch.eye(d) / feature_rms
        self.p = {
            "fc": fc,
            "in_norm": torch.ones(d),
            "hidden_norm": torch.ones(d),
            "q": rand(H * D, 2 * d),
            "k": rand(Hkv * D, 2 * d),
            "v": rand(Hkv * D, 2 * d),
            "o": rand(d, H * D),
            "post_norm": torch.ones(d),
            "gate": rand(inter, d),
            "up": rand(inter, d),
            "down": rand(d, inter),
            "norm": final_norm.float().clone(),
            "lm_head": head[draft_ids].float().clone(),
        }
        if init_layer is not None:
            # start the layer as the target's own layer at the high feature, reading the fused
            # feature through the hidden half of q|k|v (the embedding half starts small): its
            # norms' weights are tuned to that residual stream (SmolLM2's has outlier channels
            # that a plain RMSNorm would let swamp every other channel)
            L = init_layer
            self.p["hidden_norm"] = L["input_layernorm"].float().clone()
            self.p["post_norm"] = L["post_attention_layernorm"].float().clone()
            self.p["in_norm"] = L["embed_norm"].float().clone()
            for name in ("q", "k", "v"):
                w = self.p[name]
                w[:, d:] = L[f"{name}_proj"].float()
            for name in ("o", "gate", "up", "down"):
                self.p[name] = L[f"{name}_proj"].float().clone()
        for t in self.p.values():
            t.requires_grad_(True)
        self.embed = embed.float()
        self.target_head = head[draft_ids].float()  # the target's logits over the draft vocabulary
        self.draft_ids = draft_ids
        self._rope_cache: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def rope(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope_cache is None or self._rope_cache[0] < n:
            D = self.cfg.head_dim
            inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
            f = torch.outer(torch.arange(n, dtype=torch.float64), inv)
            emb = torch.cat([f, f], -1)
            self._rope_cache = (n, emb.cos().float(), emb.sin().float())
        _, cos, sin = self._rope_cache
        return cos[:n], sin[:n]

    def loss(self, batch: dict, steps: int) -> tuple[torch.Tensor, list[float], list[int]]:
        """The weighted loss over `steps` training-time-test steps; per-step top-1 agreement
        with the target and the number of positions scored."""
        p, c = self.p, self.cfg
        tokens, aux, final = batch["tokens"], batch["aux"], batch["final"]  # [B, T], [B, T, 3d], [B, T, d]
        lengths, prompt = batch["lengths"], batch["prompt"]
        B, T = tokens.shape
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        G, eps = H // Hkv, c.rms_norm_eps
        with torch.no_grad():
            target_p = torch.softmax((final @ self.target_head.T).float(), -1).view(B * T, -1)  # [B * T, N]
        idx = torch.arange(T)
        cos, sin = self.rope(T + steps)
        causal = idx.view(T, 1) >= idx.view(1, T)  # query j sees step-0 keys 0..j
        h = F.linear(aux, p["fc"])
        emb_all = F.embedding(tokens, self.embed)
        keys, values = [], []
        total = torch.zeros(())
        accs, counts = [], []
        for s in range(steps):
            # step s at index j: token x_{j+s+1}, position j + s, predicts x_{j+s+2}
            shift = torch.clamp(idx + s + 1, max=T - 1)
            emb = emb_all[:, shift]
            x = torch.cat([_rms(emb, p["in_norm"], eps), _rms(h, p["hidden_norm"], eps)], -1)
            c_s, s_s = cos[s : s + T].view(1, 1, T, D), sin[s : s + T].view(1, 1, T, D)
            q = _rope(F.linear(x, p["q"]).view(B, T, H, D).transpose(1, 2), c_s, s_s)
            k = _rope(F.linear(x, p["k"]).view(B, T, Hkv, D).transpose(1, 2), c_s, s_s)
            v = F.linear(x, p["v"]).view(B, T, Hkv, D).transpose(1, 2)
            keys.append(k.repeat_interleave(G, 1))
            values.append(v.repeat_interleave(G, 1))
            scale = D**-0.5
            scores = (q @ keys[0].transpose(-1, -2)) * scale  # [B, H, T, T]
            scores = scores.masked_fill(~causal, float("-inf"))
            diag = [(q * kt).sum(-1, keepdim=True) * scale for kt in keys[1:]]  # each [B, H, T, 1]
            w = torch.softmax(torch.cat([scores, *diag], -1), -1)
            attn = w[..., :T] @ values[0]
            for t, vt in enumerate(values[1:]):
                attn = attn + w[..., T + t : T + t + 1] * vt
            attn = attn.transpose(1, 2).reshape(B, T, H * D)
            r = h + F.linear(attn, p["o"])
            m = _rms(r, p["post_norm"], eps)
            y = r + F.linear(F.silu(F.linear(m, p["gate"])) * F.linear(m, p["up"]), p["down"])
            # scored: index j whose token j + s + 2 exists and is an answer token; the target's
            # distribution of that token is the one at position j + s + 1
            valid = ((idx + s + 2).view(1, T) < lengths.view(B, 1)) & (
                (idx + s + 1).view(1, T) >= (prompt - 1).view(B, 1)
            )
            n = int(valid.sum())
            if n == 0:
                break
            b_idx, j_idx = valid.nonzero(as_tuple=True)
            tgt = target_p[b_idx * T + j_idx + s + 1]  # [n, N]
            # the head only where scored
            logits = F.linear(_rms(y[b_idx, j_idx], p["norm"], eps), p["lm_head"])
            ce = -(tgt * torch.log_softmax(logits.float(), -1)).sum(-1)
            total = total + LOSS_DECAY**s * ce.sum() / n
            with torch.no_grad():
                accs.append(float((logits.argmax(-1) == tgt.argmax(-1)).sum()) / n)
                counts.append(n)
            h = y
        return total, accs, counts

    def state_dict(self, dtype=torch.float16) -> dict[str, torch.Tensor]:
        out = {self.NAMES[k]: v.detach().to(dtype).contiguous() for k, v in self.p.items()}
        N = len(self.draft_ids)
        out["d2t"] = (self.draft_ids - torch.arange(N)).to(torch.int64)
        t2d = torch.zeros(self.cfg.vocab_size, dtype=torch.bool)
        t2d[self.draft_ids] = True
        out["t2d"] = t2d
        return out


def _batches(
    seqs: list[list[int]], batch_tokens: int, max_len: int, rng: np.random.Generator
) -> list[list[int]]:
    """Sequence indices grouped by length (little padding), about batch_tokens tokens a batch,
    in random order."""
    order = sorted(range(len(seqs)), key=lambda i: (min(seqs[i][2], max_len), rng.random()))
    out, cur, longest = [], [], 0
    for i in order:
        n = min(seqs[i][2], max_len)
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def _load_batch(data: DistillData, seqs: list[list[int]], ids: list[int], max_len: int) -> dict:
    T = max(min(seqs[i][2], max_len) for i in ids)
    B = len(ids)
    A = data.aux.shape[1]
    d = data.final.shape[1]
    tokens = np.zeros((B, T), np.int64)
    aux = np.zeros((B, T, A), np.float32)
    final = np.zeros((B, T, d), np.float32)
    lengths, prompt = [], []
    for b, i in enumerate(ids):
        s, p, n = seqs[i]
        n = min(n, max_len)
        tokens[b, :n] = data.tokens[s : s + n]
        aux[b, :n] = data.aux[s : s + n]
        final[b, :n] = data.final[s : s + n]
        lengths.append(n)
        prompt.append(min(p, n))
    return {
        "tokens": torch.from_numpy(tokens),
        "aux": torch.from_numpy(aux),
        "final": torch.from_numpy(final),
        "lengths": torch.tensor(lengths),
        "prompt": torch.tensor(prompt),
    }


def evaluate(trainer: Eagle3Trainer, data: DistillData, seqs, ids: list[int], steps: int, max_len: int):
    """Per-step top-1 agreement with the target on held-out sequences."""
    hits = [0.0] * steps
    n = [0] * steps
    with torch.no_grad():
        for start in range(0, len(ids), 8):
            batch = _load_batch(data, seqs, ids[start : start + 8], max_len)
            _, accs, counts = trainer.loss(batch, steps)
            for s, (a, c) in enumerate(zip(accs, counts)):
                hits[s] += a * c
                n[s] += c
    return [h / max(1, c) for h, c in zip(hits, n)]


def train_eagle3(
    target: str | Path,
    data_dir: str | Path,
    out: str | Path,
    *,
    draft_vocab: int = 8192,
    ttt_steps: int = 4,
    epochs: float = 2.0,
    max_minutes: float | None = None,
    batch_tokens: int = 4096,
    max_len: int = 512,
    lr: float = 3e-4,
    seed: int = 0,
    heldout: float = 0.05,
    progress: bool = True,
    limit: int | None = None,
    bf16: bool = True,
) -> dict:
    """Train (or resume) an EAGLE-3 drafter for `target` on distilled data; write `out`.
    bf16: products in bfloat16 under autocast (parameters, softmax and loss in float32); 2x
    faster on this CPU (AVX512-BF16)."""
    from safetensors.torch import save_file

    if ttt_steps < 1 or draft_vocab < 2 or batch_tokens < 16 or not lr > 0 or not epochs > 0:
        raise SpecDecodeError(
            "need --ttt-steps >= 1, --draft-vocab >= 2, --batch-tokens >= 16, --lr > 0, --epochs > 0"
        )
    data = DistillData.open(data_dir)
    trainer, tc, draft_ids, coverage = _new_trainer(target, data, data_dir, draft_vocab, seed)
    seqs = data.sequences[:limit] if limit else data.sequences
    n_held = max(1, int(len(seqs) * heldout)) if len(seqs) > 1 else 0
    train_ids, held_ids = list(range(len(seqs) - n_held)), list(range(len(seqs) - n_held, len(seqs)))
    opt = torch.optim.AdamW(list(trainer.p.values()), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_file = out / "checkpoint.pt"
    rng = np.random.default_rng(seed)
    plan = []
    for _ in range(math.ceil(epochs)):
        plan += _batches([seqs[i] for i in train_ids], batch_tokens, max_len, rng)
    total_steps = max(1, int(len(plan) * epochs / math.ceil(epochs)))
    plan = plan[:total_steps]
    step, elapsed, history = 0, 0.0, []
    if ckpt_file.exists():  # resume
        ck = torch.load(ckpt_file, weights_only=False)
        if ck["draft_ids"].tolist() != draft_ids.tolist() or ck["total_steps"] != total_steps:
            raise SpecDecodeError(f"{ckpt_file} belongs to another run; delete it or pick a new --out")
        for k, v in ck["params"].items():
            trainer.p[k].data.copy_(v)
        opt.load_state_dict(ck["opt"])
        step, elapsed, history = ck["step"], ck["elapsed"], ck["history"]

    def save_checkpoint():
        torch.save(
            {
                "params": {k: v.detach() for k, v in trainer.p.items()},
                "opt": opt.state_dict(),
                "step": step,
                "elapsed": elapsed,
                "history": history,
                "draft_ids": draft_ids,
                "total_steps": total_steps,
            },
            ckpt_file,
        )

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    budget = max_minutes * 60 if max_minutes else None
    columns = (TextColumn("eagle3"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"))
    t_start, last_save = time.perf_counter() - elapsed, time.perf_counter()
    accs_avg: list[float] = []
    recent: list[list[float]] = []  # the last 20 steps' top-1 agreement per step
    with Progress(*columns, TimeElapsedColumn(), disable=not progress) as bar:
        task = bar.add_task("eagle3", total=total_steps, completed=step, info="")
        while step < total_steps:
            elapsed = time.perf_counter() - t_start
            frac = step / total_steps
            if budget:
                frac = max(frac, elapsed / budget)
                if frac >= 1:
                    break
            warm = min(1.0, (step + 1) / 20)
            for grp in opt.param_groups:
                grp["lr"] = lr * warm * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
            batch = _load_batch(data, seqs, [train_ids[i] for i in plan[step]], max_len)
            loss, accs = _step(trainer, opt, batch, ttt_steps, bf16)
            step += 1
            recent.append(accs)
            recent = recent[-20:]
            accs_avg = [float(np.mean([r[i] for r in recent if i < len(r)])) for i in range(len(recent[-1]))]
            if step % 20 == 0:
                history.append(
                    {
                        "step": step,
                        "seconds": round(elapsed, 1),
                        "loss": round(loss.item(), 4),
                        "top1": [round(a, 3) for a in accs_avg],
                    }
                )
            bar.update(
                task,
                completed=step,
                info=f"loss {loss.item():.3f} top-1 " + " ".join(f"{a:.2f}" for a in accs_avg),
            )
            if time.perf_counter() - last_save > 120:
                elapsed = time.perf_counter() - t_start
                save_checkpoint()
                last_save = time.perf_counter()
    elapsed = time.perf_counter() - t_start
    save_checkpoint()
    held = evaluate(trainer, data, seqs, held_ids, ttt_steps, max_len) if held_ids else []
    state = trainer.state_dict()
    save_file(state, str(out / "model.safetensors"))
    cfg = write_config(
        out,
        tc,
        data,
        len(draft_ids),
        {
            "kind": KIND,
            "target": str(target),
            "data": str(data_dir),
            "draft_vocab_coverage": round(coverage, 4),
            "ttt_steps": ttt_steps,
            "steps": step,
            "planned_steps": total_steps,
            "train_seconds": round(elapsed, 1),
            "train_sequences": len(train_ids),
            "train_tokens": int(sum(seqs[i][2] for i in train_ids)),
            "heldout_sequences": len(held_ids),
            "heldout_top1_per_step": [round(a, 4) for a in held],
            "lr": lr,
            "batch_tokens": batch_tokens,
            "seed": seed,
            "history": history,
        },
    )
    return cfg["specdecode"]


def _new_trainer(target: str | Path, data: DistillData, data_dir, draft_vocab: int, seed: int):
    """(Eagle3Trainer, the target's config, the draft vocabulary's ids, its coverage): the drafter
    initialised from the target's embeddings, LM head, final norm and last auxiliary layer."""
    from ..models import load

    model = load(target, dtype=torch.float32)
    if not model.lean:
        raise SpecDecodeError("train-heads --method eagle3 needs a Llama target on our lean runtime")
    tc = model.cfg
    if data.index["hidden_size"] != tc.hidden_size or data.index["vocab_size"] != tc.vocab_size:
        raise SpecDecodeError(f"{data_dir} was distilled from another model than {target}")
    torch.manual_seed(seed)
    draft_ids, coverage = draft_vocabulary(data, draft_vocab, tc.vocab_size)
    sample = np.asarray(data.aux[: min(len(data.tokens), 20_000), 2 * tc.hidden_size :], dtype=np.float32)
    feature_rms = float(np.sqrt((sample**2).mean())) or 1.0
    init_layer = _target_layer(target, int(data.index["aux_layers"][2]))
    trainer = Eagle3Trainer(
        tc, model.embed, model.lm_head, model.final_norm, draft_ids, seed, feature_rms, init_layer
    )
    return trainer, tc, draft_ids, coverage


def _step(trainer: Eagle3Trainer, opt, batch, ttt_steps: int, bf16: bool) -> tuple[torch.Tensor, list[float]]:
    """One optimiser step (bf16 products under autocast when asked); returns (loss, top-1 per step)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss, accs, _ = trainer.loss(batch, ttt_steps)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(trainer.p.values()), 1.0)
    opt.step()
    return loss, accs


def _target_layer(target: str | Path, i: int) -> dict[str, torch.Tensor]:
    """The target's layer i (its norms, projections) and layer 0's input norm, from its files."""
    from safetensors import safe_open

    from ..models import resolve

    path = resolve(target)
    names = {
        "input_layernorm": f"model.layers.{i}.input_layernorm.weight",
        "post_attention_layernorm": f"model.layers.{i}.post_attention_layernorm.weight",
        "embed_norm": "model.layers.0.input_layernorm.weight",
        **{f"{n}_proj": f"model.layers.{i}.self_attn.{n}_proj.weight" for n in "qkvo"},
        **{f"{n}_proj": f"model.layers.{i}.mlp.{n}_proj.weight" for n in ("gate", "up", "down")},
    }
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            keys = set(fh.keys())
            out.update({k: fh.get_tensor(v) for k, v in names.items() if v in keys})
    missing = set(names) - set(out)
    if missing:
        raise SpecDecodeError(f"{path}: cannot read layer {i} ({sorted(missing)[0]} missing)")
    return out


def write_config(out: Path, tc, data: DistillData, draft_vocab: int, meta: dict) -> dict:
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": tc.hidden_size,
        "intermediate_size": tc.intermediate_size,
        "num_attention_heads": tc.num_heads,
        "num_key_value_heads": tc.num_kv_heads,
        "head_dim": tc.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": float(f"{tc.rms_norm_eps:.6g}"),
        "rope_theta": tc.rope_theta,
        "max_position_embeddings": 8192,
        "vocab_size": tc.vocab_size,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": tc.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(data.index["aux_layers"]),
        "norm_before_residual": False,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float16",
        "specdecode": meta,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return cfg
