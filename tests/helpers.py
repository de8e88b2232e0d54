"""Shared test helpers: tiny random checkpoints and the statistical exactness check."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specdecode.lab.stats import chi2_pvalue, noise_tvs, tv
from specdecode.models.base import logits_of
from specdecode.models.init import init_model


def noisy_copy(src: Path, out: Path, noise: float, seed: int) -> Path:
    """A draft that partly agrees with its target: the target's weights plus Gaussian noise."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    g = torch.Generator().manual_seed(seed)
    for f in src.glob("*.safetensors"):
        w = load_file(str(f))
        w = {
            k: (v + noise * v.std() * torch.randn(v.shape, generator=g, dtype=v.dtype)).contiguous()
            for k, v in w.items()
        }
        save_file(w, str(out / f.name), metadata={"format": "pt"})
    return out


def tiny_pair(root: Path, vocab: int = 64, noise: float = 0.05, init_std: float = 0.3) -> tuple[Path, Path]:
    """A random target (2 layers, GQA) and a noisy copy of it as the draft."""
    target = init_model(
        root / "target", vocab=vocab, layers=2, dim=32, seed=0, heads=4, kv_heads=2, init_std=init_std
    )
    return target, noisy_copy(target, root / "draft", noise=noise, seed=1)


def tv_noise_threshold(p: np.ndarray, n: int, sims: int = 64, seed: int = 0) -> float:
    """Mean + 4 std of TV(empirical, p) for n direct draws from p, from `sims` simulations."""
    tvs = noise_tvs(p, n, sims, seed)
    return float(np.mean(tvs) + 4 * np.std(tvs))


def check_distribution(samples: np.ndarray, p: np.ndarray) -> tuple[bool, str]:
    """True when samples are consistent with p: TV within sampling noise AND chi-square p > 1e-4."""
    counts = np.bincount(samples, minlength=len(p)).astype(np.float64)
    n = int(counts.sum())
    d, limit, pv = tv(counts, p), tv_noise_threshold(p, n), chi2_pvalue(counts, p)
    msg = f"TV {d:.5f} (noise limit {limit:.5f}), chi-square p {pv:.3g}, n {n}"
    if os.environ.get("SPECDECODE_MARGINS"):  # a file to append each check's margin to
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(os.environ["SPECDECODE_MARGINS"], "a") as f:
            f.write(f"{test}\tTV/limit {d / limit:.3f}\t{msg}\n")
    return (d <= limit and pv > 1e-4), msg


def tiny_hf_model(
    kind: str, out: Path, *, vocab: int, seed: int, init_std: float = 0.02, n_positions: int = 256
) -> Path:
    """A random non-Llama checkpoint (GPT-2 or Qwen2 layout) for the transformers adapter."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = GPT2Config(
            vocab_size=vocab,
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=n_positions,
            initializer_range=init_std,
        )
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = Qwen2Config(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            initializer_range=init_std,
        )
        model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(out)
    return out


def two_token_joint(target, prompt: list[int]) -> np.ndarray:
    """P(x1, x2 | prompt) at T = 1 from full forwards, flattened to [V * V] (x1 * V + x2); the
    softmax in float64 whatever the model's dtype."""
    V = target.vocab_size
    first = logits_of(target, torch.tensor([prompt]), target.new_cache(1, len(prompt) + 2))[0, -1]
    p1 = torch.softmax(first.double(), -1)
    seqs = torch.tensor([prompt + [x] for x in range(V)])
    p2 = torch.softmax(logits_of(target, seqs, target.new_cache(V, len(prompt) + 2))[:, -1].double(), -1)
    return (p1.view(V, 1) * p2).numpy().ravel()


def draft_pair_two_tokens(target, draft, prompt: list[int], runs: int, k: int = 2, seed: int = 41):
    """(sampled (x1, x2) as x1 * V + x2 [runs], the target's exact joint [V * V], the acceptance
    rate) of `runs` independent 2-token samples at T = 1 through a draft-model generator."""
    from specdecode import SamplingParams, SpeculativeGenerator

    params = SamplingParams(temperature=1.0, max_new_tokens=2, seed=seed, ignore_eos=True)
    gen = SpeculativeGenerator(target, draft=draft, k=k)
    results = gen.generate([prompt] * runs, independent(params, runs))
    V = target.vocab_size
    pairs = np.array([r.token_ids[0] * V + r.token_ids[1] for r in results])
    joint = two_token_joint(target, prompt)
    rate = sum(r.stats.accepted for r in results) / sum(r.stats.tested for r in results)
    return pairs, joint / joint.sum(), rate


def independent(params, n: int) -> list:
    """n rows of params drawing independent samples, the cheapest way that repeats: standard-rule
    rows unseeded (they draw together from torch's default generator, seeded here with
    params.seed), invariant-rule rows with seeds seed, seed + 1, ... (each needs its own key)."""
    from dataclasses import replace

    if params.sampling_rule == "invariant":
        return seeded(params, n)
    torch.manual_seed(params.seed)
    return [replace(params, seed=None)] * n


def seeded(params, n: int) -> list:
    """n copies of params with seeds seed, seed + 1, ...: independent, reproducible samples (a
    seed fixes a row's samples, so n rows with one seed would all draw the same)."""
    from dataclasses import replace

    return [replace(params, seed=params.seed + i) for i in range(n)]


def resample_from_p_after_rejection(monkeypatch) -> None:
    """Negative control: the engine's chain verifier redraws a rejected position from the target
    probs p instead of the residual norm(max(0, p - q)) (lesson 001's error)."""
    import specdecode.engine.verify as verify_mod
    from specdecode.core.sampling import sample

    real = verify_mod.verify_chain

    def biased(draft_tokens, draft_probs, target_probs, uniforms, noise, draft_lengths=None):
        v = real(draft_tokens, draft_probs, target_probs, uniforms, noise, draft_lengths)
        B, k = draft_tokens.shape
        rejected = v.accepted < v.draft_lengths
        at = v.accepted.view(B, 1, 1).expand(B, 1, target_probs.shape[-1])
        redraw = sample(target_probs.gather(1, at).squeeze(1), noise)
        kept = v.tokens.gather(1, v.accepted.view(B, 1)).squeeze(1)
        v.tokens.scatter_(1, v.accepted.view(B, 1), torch.where(rejected, redraw, kept).view(B, 1))
        return v

    monkeypatch.setattr(verify_mod, "verify_chain", biased)


CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# Hugging Face layer tensor -> GGUF name (llama.cpp's converter); the inverse of gguf_import's map
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(
    root: Path, arch: str = "llama", embed_q8: bool = False, seed: int = 0
) -> tuple[Path, Path]:
    """A random Llama checkpoint (transformers layout) and the same weights as a GGUF written the
    way llama.cpp's converter writes one: q/k rows permuted, GGUF tensor names, a byte-level BPE
    vocabulary with two merges, ChatML control tokens, the 'smollm' pre-tokenizer and a ChatML
    chat template. embed_q8 stores the embedding as Q8_0 (the rest F32). Returns (hf_dir, gguf)."""
    import gguf
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|endoftext|>", *alphabet, "<|im_start|>", "<|im_end|>", "he", "hel"]
    hf = init_model(
        root / "hf", vocab=len(tokens), layers=2, dim=32, heads=4, kv_heads=2, seed=seed, init_std=0.3
    )
    w = {k: v.float().numpy() for k, v in load_file(str(hf / "model.safetensors")).items()}
    heads, kv_heads = 4, 2

    def permute(a: np.ndarray, n: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf permutation
        return a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    path = root / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(4096)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(128)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(["h e", "he l"])
    writer.add_bos_token_id(len(alphabet) + 1)
    writer.add_eos_token_id(len(alphabet) + 2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    names = GGUF_LAYER_NAMES
    for name, a in w.items():
        if name == "model.embed_tokens.weight":
            if embed_q8:
                q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(
                    "token_embd.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0
                )
                continue
            writer.add_tensor("token_embd.weight", a)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", a)
        elif name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            part = ".".join(rest[:-1])
            if part == "self_attn.q_proj":
                a = permute(a, heads)
            elif part == "self_attn.k_proj":
                a = permute(a, kv_heads)
            writer.add_tensor(f"blk.{i}.{names[part]}.weight", np.ascontiguousarray(a))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf, path


def _random_k_quant(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of a K-quant tensor (Q4_K or Q6_K; [rows, bytes]) whose fp16 super-block
    scales are small and finite: every block decodes to ordinary weights."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin (fp16) lead the block
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:  # Q6_K: d (fp16) ends the block
        raw[..., -2:] = scale
    return raw.reshape(rows, -1)


def write_tiny_qwen_gguf(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """A random Qwen2 GGUF with the real pair's tensor types (Q4_K, Q6_K, Q5_0, Q8_0, F32 norms
    and q/k/v biases, an untied output matrix), a byte-level BPE vocabulary with the 'qwen2'
    pre-tokenizer and a ChatML template, and a transformers Qwen2 checkpoint holding exactly the
    weights the GGUF decodes to. Returns (hf_dir, gguf)."""
    import gguf
    from tokenizers import pre_tokenizers

    T = gguf.GGMLQuantizationType
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|endoftext|>", *alphabet, "<|im_start|>", "<|im_end|>", "he", "hel"]
    heads, kv_heads, dim, inter, layers = 4, 2, 256, 512, 2
    hf = init_model(
        root / "hf",
        vocab=len(tokens),
        layers=layers,
        dim=dim,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=inter,
        seed=seed,
        init_std=0.05,
        tie_embeddings=False,
        arch="qwen2",
    )
    w = {k: v.float().numpy() for k, v in load_file(str(hf / "model.safetensors")).items()}
    cfg = json.loads((hf / "config.json").read_text())  # Qwen's RoPE base, as the GGUF says
    cfg["rope_parameters"] = {**(cfg.get("rope_parameters") or {}), "rope_theta": 1e6, "rope_type": "default"}
    (hf / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(seed)
    # the real pair's mix: K-quants in the projections, Q5_0 embedding, Q8_0 head, F32 the rest
    kinds = {
        "q_proj": T.Q4_K,
        "k_proj": T.Q4_K,
        "o_proj": T.Q4_K,
        "gate_proj": T.Q4_K,
        "up_proj": T.Q4_K,
        "v_proj": T.Q6_K,
        "down_proj": T.Q6_K,
        "embed_tokens": T.Q5_0,
        "lm_head": T.Q8_0,
    }
    names = GGUF_LAYER_NAMES
    path = root / "tiny-qwen2.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(["h e", "he l"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(len(alphabet) + 2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    decoded = {}
    for name, a in w.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, i, *rest = name.split(".")
            gname = f"blk.{i}.{names['.'.join(rest[:-1])]}.{rest[-1]}"
        kind = next((t for key, t in kinds.items() if key in name and name.endswith(".weight")), None)
        if kind is None:
            writer.add_tensor(gname, np.ascontiguousarray(a))
            decoded[name] = a
            continue
        if kind in (T.Q4_K, T.Q6_K):
            q = _random_k_quant(a.shape[0], a.shape[1], kind, rng)
        else:
            q = gguf.quants.quantize(a, kind)
        writer.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=kind)
        decoded[name] = gguf.quants.dequantize(q, kind).reshape(a.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # the transformers checkpoint holds what the GGUF decodes to: identical models
    save_file(
        {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in decoded.items()},
        str(hf / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return hf, path


def random_heads(d: int, h: int = 3, seed: int = 0, scale: float = 0.3):
    """Random Medusa heads (h heads on a d-wide hidden state), float64: exact but weak drafts."""
    from specdecode.drafters.medusa import MedusaHeads

    g = torch.Generator().manual_seed(seed)
    return MedusaHeads(
        torch.randn(h, d, d, generator=g, dtype=torch.float64) * scale / d**0.5,
        torch.randn(h, d, generator=g, dtype=torch.float64) * scale,
    )


def write_prompts(path, prompts) -> None:
    """A distill-data prompts file of token-id prompts."""
    import json

    path.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))


def train_tiny_eagle3(target_dir, root, prompts, draft_vocab, tokens=24):
    """distill-data on `prompts` (greedy and T = 1 answers), then a short EAGLE-3 training:
    (the data directory, the drafter directory)."""
    from specdecode.train.distill import distill
    from specdecode.train.eagle3 import train_eagle3

    write_prompts(root / "p.jsonl", prompts)
    data = root / "data"
    distill(
        target_dir,
        root / "p.jsonl",
        data,
        chat=False,
        max_new_tokens=tokens,
        temperature="0,1",
        batch_size=4,
        dtype=torch.float32,
        progress=False,
    )
    train_eagle3(
        target_dir,
        data,
        root / "e3",
        draft_vocab=draft_vocab,
        ttt_steps=2,
        epochs=2,
        batch_tokens=256,
        progress=False,
    )
    return data, root / "e3"


def train_tiny_eagle(target_dir, out, lines: list[str], seq_len: int):
    """A briefly trained EAGLE drafter (train-heads, 3 steps) on a corpus of these lines."""
    from specdecode.train.heads import train_eagle

    out.mkdir(parents=True, exist_ok=True)
    text = out / "corpus.txt"
    text.write_text("".join(line + "\n" for line in lines))
    train_eagle(target_dir, text, out / "eagle", steps=3, batch_size=4, seq_len=seq_len, progress=False)
    return out / "eagle"


def churn(gen, prompts: list, params: list) -> tuple[list[list[int]], dict[str, int]]:
    """Run the rows through one Generation with admissions between rounds: three rows start,
    the others begin one at a time and prefill 2 prompt tokens a round (join when done) while
    earlier rows finish. Returns every row's tokens (admission order) and how the target cache
    took each join: into a free slot of the same storage ("free"), into the storage staged while
    the prefill ran ("staged"), or into storage made at the join ("new")."""
    run = gen.stream(prompts[:3], params[:3])
    waiting, pending = list(range(3, len(prompts))), None
    joins = {"free": 0, "staged": 0, "new": 0}
    while run.rows.size or pending is not None or waiting:
        if pending is None and waiting:
            i = waiting.pop(0)
            pending = run.begin([prompts[i]], [params[i]])
        elif pending is not None:
            pending.step(2)
            if pending.done:
                cache = run.cache
                before, staged = cache._k.data_ptr(), cache._staged
                run.join(pending)
                if run.cache is cache and cache._k.data_ptr() == before:
                    joins["free"] += 1
                elif run.cache is cache and staged is not None and cache._k is staged.k:
                    joins["staged"] += 1
                else:
                    joins["new"] += 1
                pending = None
        if run.rows.size:
            next(run)
    return [r.token_ids for r in run.results()], joins
