"""Our lean runtime for Llama-architecture checkpoints (RMSNorm, RoPE, SwiGLU, grouped-query
attention, tied or untied embeddings), read from config.json + *.safetensors. The Qwen2 and
Qwen3 families are the same decoder with two differences each, read from `model_type`: qwen2
has q/k/v biases (no output-projection bias); qwen3 has no biases and an RMSNorm over each
head's query and key (`q_norm`, `k_norm`, before RoPE).

Plain tensors and torch.nn.functional, no nn.Module tree: q/k/v and gate/up are fused into
one matmul each; the KV cache is written by position (cache.py). Logits match
transformers.LlamaForCausalLM on the same checkpoint (tests/test_models.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import SpecDecodeError
from ..progress import bar
from .base import PLAIN, ForwardMeta
from .cache import KVCache
from .forward_plan import ForwardPlan, plan_forward
from .linear import Linear
from .quant import (
    KERNEL_KINDS,
    QUANT_KINDS,
    QWeight,
    choose_int8_kernels,
    linear_nbytes,
    part_kind,
    quantized_linear,
)
from .rope import RopeTables
from .tokenizer import TextTokenizer

# the config.json model types this runtime runs (others go to the transformers adapter)
LEAN_MODEL_TYPES = ("llama", "qwen2", "qwen3", "specdecode_hybrid")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    # hybrid models (model_type specdecode_hybrid): "linear_attention" or "full_attention" per
    # layer (models/linear_attention.py); None: every layer is full attention
    layer_types: tuple[str, ...] | None = None
    # qwen3: an RMSNorm over each head's query and key before RoPE (weights q_norm, k_norm [D])
    qk_norm: bool = False

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types or ()) if t == "linear_attention"]

    @staticmethod
    def from_dict(cfg: dict) -> LlamaConfig:
        """Parse a Hugging Face Llama, Qwen2 or Qwen3 config (or our hybrid one, a Llama config
        with layer_types); raise NotImplementedError for what we don't run."""
        kind = cfg.get("model_type")
        if kind not in LEAN_MODEL_TYPES:
            raise NotImplementedError(f"model_type {kind!r} is not one of {', '.join(LEAN_MODEL_TYPES)}")
        if kind in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            window, layers = cfg.get("sliding_window"), cfg.get("max_window_layers", 0)
            if window and layers < cfg["num_hidden_layers"]:
                raise NotImplementedError(f"sliding-window attention ({window} tokens)")
        layer_types = None
        if cfg.get("model_type") == "specdecode_hybrid":
            layer_types = tuple(cfg.get("layer_types") or ())
            if len(layer_types) != cfg["num_hidden_layers"] or not set(layer_types) <= {
                "linear_attention",
                "full_attention",
            }:
                raise SpecDecodeError(
                    "a specdecode_hybrid config needs layer_types: one of linear_attention or "
                    f"full_attention per layer ({cfg['num_hidden_layers']}), got {list(layer_types)}"
                )
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg['hidden_act']!r}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"rope_type {rope_type!r}")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        return LlamaConfig(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # qwen2's q/k/v always carry a bias (its config has no attention_bias key); the
            # loader reads whichever bias tensors the checkpoint has
            attention_bias=cfg.get("attention_bias", kind == "qwen2"),
            mlp_bias=cfg.get("mlp_bias", False),
            layer_types=layer_types,
            qk_norm=kind == "qwen3",
        )


@dataclass
class _Layer:
    """One decoder layer: its norms' weights and four projections (q|k|v and gate|up fused)."""

    attn_norm: torch.Tensor
    qkv: Linear  # hidden -> (H + 2*Hkv) * D
    o: Linear  # H * D -> hidden
    mlp_norm: torch.Tensor
    gate_up: Linear  # hidden -> 2 * inter
    down: Linear  # inter -> hidden
    # EAGLE-3's input layer: q|k|v read [attn_norm(embedding of the token), hidden_norm(x)]
    # (2 * hidden inputs) while x, the fed feature, stays the residual
    hidden_norm: torch.Tensor | None = None
    # a linear-attention layer: qkv projects to q|k|v|α|β (3·H·D + 2·H), no KV cache
    linear: bool = False
    # qwen3: the per-head query and key norms' weights, one row per q head then per kv head
    # ([H + Hkv, D]), so one norm covers q and k
    qk_norm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        root_d = self.attn_norm.shape[0] ** 0.5  # the norms' weights times √d (see _rms_norm)
        self.attn_norm_s = self.attn_norm * root_d
        self.mlp_norm_s = self.mlp_norm * root_d
        self.hidden_norm_s = None if self.hidden_norm is None else self.hidden_norm * root_d
        self.qk_norm_s = None if self.qk_norm is None else self.qk_norm * self.qk_norm.shape[-1] ** 0.5

    def num_parameters(self) -> int:
        return (
            self.attn_norm.numel()
            + self.mlp_norm.numel()
            + (0 if self.hidden_norm is None else self.hidden_norm.numel())
            + (0 if self.qk_norm is None else self.qk_norm.numel())
            + sum(p.numel for p in (self.qkv, self.o, self.gate_up, self.down))
        )


class _LazyWeights(Mapping):
    """The tensors of a directory's *.safetensors files, each read from its file only when asked
    for: the runtime converts and repacks one matrix at a time, so loading never holds the
    whole checkpoint twice."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise SpecDecodeError(f"no *.safetensors weights in {path}")
        self._where = {}
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                self._where.update(dict.fromkeys(fh.keys(), f))

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        # opened per tensor and copied out: the file's memory map is released at once, so its
        # pages never add up in the resident set (a shared tensor would keep all of it mapped)
        with safe_open(str(self._where[name]), framework="pt") as fh:
            return fh.get_tensor(name).clone()

    def mapped(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The tensor as a view of the file's memory map (no copy; only the pages that are read
        become resident), or None when it is stored in another dtype."""
        from safetensors import safe_open

        with safe_open(str(self._where[name]), framework="pt") as fh:
            t = fh.get_tensor(name)
        return t if t.dtype == dtype else None

    def stored(self, name: str) -> torch.Tensor:
        """The tensor as a view of the file's memory map in its stored dtype (no copy)."""
        from safetensors import safe_open

        with safe_open(str(self._where[name]), framework="pt") as fh:
            return fh.get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def return_freed_memory() -> None:
    """Hand the heap memory that loading freed (one converted copy of each matrix at a time)
    back to the OS: glibc keeps it otherwise, ~30 MB on SmolLM2. A no-op off glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@functools.cache
def _kernel_built() -> bool:
    from ..kernels import available

    return available()


def _rms_norm(
    x: torch.Tensor, scaled_weight: torch.Tensor, d_eps: float, invariant: bool = False
) -> torch.Tensor:
    """RMSNorm x / sqrt(mean(x²) + eps) * w, written as x * (w √d) / sqrt(Σx² + d·eps): with the
    √d folded into the weight at load time it is three small kernels (F.rms_norm is six on CPU).
    invariant: the norm is reduced in float32 (a bf16 norm over 32 or more rows takes another
    reduction order than over fewer, so a row's result would depend on its neighbours)."""
    if invariant:
        sum_sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32).square_()
    else:
        sum_sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_()
    return (x * scaled_weight).mul_(sum_sq.add_(d_eps).rsqrt_())


class LlamaModel:
    """A Llama checkpoint on our runtime: forward(tokens [B, T], cache, meta) -> (logits [B, T, V],
    hidden [B, T, d] or None)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        quant: str | None = None,
        qweights: Mapping[str, QWeight] | None = None,
    ) -> None:
        """quant: int8, int4 or int4-g128 to run every projection and the LM head through
        weight-only quantized kernels (models/quant.py), quantized from `weights` at load;
        `dtype` stays the activations' type. qweights: projections already quantized (a GGUF's
        own blocks, models/gguf_quant.py), used as they are instead of their float weights."""
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.vocab_size = cfg.vocab_size
        self.quant = quant
        qweights = qweights or {}
        if quant is not None and quant not in QUANT_KINDS:
            raise SpecDecodeError(f"unknown weight format {quant!r}; choose one of {', '.join(QUANT_KINDS)}")

        def w(name: str) -> torch.Tensor:
            return weights[name].to(self.device, dtype)

        def opt(name: str) -> torch.Tensor | None:
            return weights[name].to(self.device, dtype) if name in weights else None

        def cat(names: list[str]) -> torch.Tensor:
            return torch.cat([w(n) for n in names])

        def cat_opt(names: list[str]) -> torch.Tensor | None:
            parts = [opt(n) for n in names]
            return torch.cat(parts) if all(p is not None for p in parts) else None

        def lin(names: list[str], bias: torch.Tensor | None = None, part: str = ""):
            """One projection stacking the named [out, in] weights (part: which one, for kq3)."""
            if quant is None:
                return Linear(cat(names), bias)
            f32 = torch.float32
            parts = [qweights[n] if n in qweights else weights[n].to(self.device, f32) for n in names]
            return quantized_linear(parts, bias, part_kind(quant, part), onednn=None)

        self.final_norm = w("model.norm.weight")
        self._final_norm_s = self.final_norm * cfg.hidden_size**0.5
        embed = "model.embed_tokens.weight"
        if quant is not None:  # the head quantized; the table the lookups read stays float
            head = "lm_head.weight" if "lm_head.weight" in weights and not cfg.tie_word_embeddings else embed

            # both plain tables stay in the file's memory map on CPU, as stored (only the rows
            # read become resident; lookups are cast to `dtype`, exactly: the file's values): the
            # head runs quantized, and its plain copy is made only for a drafter that reads it
            def plain(name: str) -> torch.Tensor:
                mapped = weights.stored(name) if isinstance(weights, _LazyWeights) else None
                return mapped if mapped is not None and self.device.type == "cpu" else w(name)

            self.embed = plain(embed)
            self._lm_head = self.embed if head == embed else plain(head)
            self._head = lin([head], part="head")
        elif "lm_head.weight" in weights and not cfg.tie_word_embeddings:
            self.embed = w(embed)
            self.lm_head = w("lm_head.weight")
        else:
            # tied: the head gets its own (packed) copy; the plain table the lookups read is
            # left in the file's memory map on CPU, so only the rows of tokens seen become
            # resident instead of a second copy of the whole table
            mapped = weights.mapped(embed, dtype) if isinstance(weights, _LazyWeights) else None
            if mapped is not None and self.device.type == "cpu":
                self.embed = mapped
                self._set_head(mapped, pack_from=w(embed))
            else:
                self.embed = w(embed)
                self.lm_head = self.embed
        self.layers: list[_Layer] = []
        linear = set(cfg.linear_layers)
        # attention layer i keeps its keys and values in cache layer kv_index[i]
        self.kv_index = {i: j for j, i in enumerate(i for i in range(cfg.num_layers) if i not in linear)}
        for i in bar(range(cfg.num_layers), "loading layers", enabled=quant is not None):
            p = f"model.layers.{i}."
            if i in linear:
                la = p + "linear_attn."
                H = cfg.num_heads
                bias = torch.cat(
                    [
                        torch.zeros(3 * H * cfg.head_dim, dtype=dtype, device=self.device),
                        w(la + "a_proj.bias"),
                        torch.zeros(H, dtype=dtype, device=self.device),
                    ]
                )
                mlp = [p + "mlp.gate_proj", p + "mlp.up_proj"]
                self.layers.append(
                    _Layer(
                        attn_norm=w(p + "input_layernorm.weight"),
                        qkv=lin([la + f"{n}_proj.weight" for n in "qkvab"], bias),
                        o=lin([la + "o_proj.weight"]),
                        mlp_norm=w(p + "post_attention_layernorm.weight"),
                        gate_up=lin([n + ".weight" for n in mlp], part="gate_up"),
                        down=lin([p + "mlp.down_proj.weight"]),
                        linear=True,
                    )
                )
                continue
            qkv = [p + f"self_attn.{n}_proj" for n in "qkv"]
            mlp = [p + "mlp.gate_proj", p + "mlp.up_proj"]
            qk_norm = None
            if cfg.qk_norm:
                qn, kn = w(p + "self_attn.q_norm.weight"), w(p + "self_attn.k_norm.weight")
                qk_norm = torch.cat([qn.expand(cfg.num_heads, -1), kn.expand(cfg.num_kv_heads, -1)])
            self.layers.append(
                _Layer(
                    attn_norm=w(p + "input_layernorm.weight"),
                    qkv=lin([n + ".weight" for n in qkv], cat_opt([n + ".bias" for n in qkv])),
                    o=lin([p + "self_attn.o_proj.weight"], opt(p + "self_attn.o_proj.bias")),
                    mlp_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=lin([n + ".weight" for n in mlp], cat_opt([n + ".bias" for n in mlp]), "gate_up"),
                    down=lin([p + "mlp.down_proj.weight"], opt(p + "mlp.down_proj.bias")),
                    hidden_norm=opt(p + "hidden_norm.weight"),
                    qk_norm=qk_norm,
                )
            )
        # RoPE tables (rope.py): the same bits whatever their size, grown on demand
        self._rope = RopeTables(self.cfg.rope_theta, self.cfg.head_dim, self.dtype, self.device)
        self._rope_len = 0
        self._cos = self._sin = self._rope.cos
        self.name = ""
        self.path = Path()
        self.tokenizer: TextTokenizer | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self.max_positions: int | None = None  # RoPE: no hard limit
        # hybrid models: how new caches roll linear-attention states back (snapshot, recompute)
        self.rollback = "snapshot"
        # forwards waiting to be carried through the next forward's pass (ride())
        self.riders: list = []
        self.int8_kernels: dict = {}
        if quant == "w8a8":
            self._choose_int8_kernels()

    def _choose_int8_kernels(self) -> None:
        """w8a8: each projection shape's kernel per row count (FBGEMM or oneDNN, the same bits),
        timed on this model's own layers at load (models/quant.py, choose_int8_kernels)."""
        self.int8_kernels = choose_int8_kernels([lin for _, lin in self.linears()])

    # -- capabilities (the engine and drafters ask these, never the class) ------------------
    # a forward of fused layers with one (tokens, cache) and no aux layers runs all its layers as
    # one C call (kernels.layers: the fused layers' calls in their order, the same bits)
    layers_in_c = True
    lean = True  # our runtime: token trees, offsets, early exit, fused inputs, aux layers

    @property
    def kernel_attention(self) -> bool:
        """The batch-invariant forward's attention runs in specdecode's kernel (models/invariant.py
        KernelAttention: one C call a layer, each query alone over the float32 keys and values the
        invariant cache holds) instead of InvariantAttention's chunked GEMMs: every model on the
        CPU where the kernel is built (kq, and float models of any dtype)."""
        if self.cfg.linear_layers or self.device.type != "cpu" or self.quant not in (None, *KERNEL_KINDS):
            return False
        return _kernel_built()

    @property
    def fused_layers(self) -> bool:
        """The batch-invariant forward runs each layer as five C calls (models/llama.py
        _fused_attention_block): RMSNorm inside the q|k|v and gate|up products, RoPE, the cache
        write and the attention in one, SwiGLU inside the down product, residuals and biases in
        the products' epilogue. Float32 models whose projections all run on the kernel (kq, or
        float weights in layout 'kernel': models/linear.py) without Qwen3's q/k norms or EAGLE-3's
        input layer; every invariant forward of such a model takes it (prefill, decode, trees,
        riders), so they all agree bit for bit."""
        return (
            self.dtype == torch.float32
            and self.kernel_attention
            and (
                self.quant in KERNEL_KINDS
                or all(getattr(p, "layout", "") == "kernel" for _, p in self.linears())
            )
            and not self.cfg.qk_norm
            and all(layer.hidden_norm is None for layer in self.layers)
        )

    @property
    def supports_invariant(self) -> bool:
        """A batch-invariant forward exists (not for linear-attention layers)."""
        return not self.cfg.linear_layers

    @property
    def hybrid(self) -> bool:
        """Linear-attention layers whose recurrent state a rejected draft must roll back."""
        return bool(self.cfg.linear_layers)

    @staticmethod
    def from_dir(
        path: Path,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        quant: str | None = None,
        qweights: Mapping[str, QWeight] | None = None,
    ) -> LlamaModel:
        cfg_dict = json.loads((path / "config.json").read_text())
        return LlamaModel(LlamaConfig.from_dict(cfg_dict), _LazyWeights(path), dtype, device, quant, qweights)

    def num_parameters(self) -> int:
        n = self.embed.numel() + self.final_norm.numel()
        if self._lm_head is not self.embed:
            n += self._lm_head.numel()
        return n + sum(layer.num_parameters() for layer in self.layers)

    def linears(self) -> list[tuple[str, object]]:
        """(name, projection) for every projection and the LM head."""
        out = [
            (f"layers.{i}.{n}", getattr(layer, n))
            for i, layer in enumerate(self.layers)
            for n in ("qkv", "o", "gate_up", "down")
        ]
        return [*out, ("head", self._head)]

    def weight_bytes(self) -> int:
        """Bytes of weights one token's forward reads: every projection and the head as stored
        (quantized ones at their packed size), the norms, one embedding row."""
        size = torch.empty(0, dtype=self.dtype).element_size()
        norms = self.final_norm.numel() + sum(
            layer.num_parameters() - sum(p.numel for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
            for layer in self.layers
        )
        return sum(linear_nbytes(p) for _, p in self.linears()) + (norms + self.cfg.hidden_size) * size

    def quantize(self, kind: str) -> LlamaModel:
        """Replace every projection and the LM head, in place, by its `kind` (int8, int4,
        int4-g128) weight-only quantized version; activations keep `self.dtype`. Returns self."""
        if kind not in QUANT_KINDS:
            raise SpecDecodeError(f"unknown weight format {kind!r}; choose one of {', '.join(QUANT_KINDS)}")
        if self.quant == kind:
            return self
        if self.quant is not None:
            name = self.name or "this model"
            raise SpecDecodeError(f"{name} is already {self.quant}; load it in float first")
        for layer in self.layers:
            for n in ("qkv", "o", "gate_up", "down"):
                old = getattr(layer, n)
                made = quantized_linear([old.weight_matrix()], old.bias, part_kind(kind, n), onednn=None)
                setattr(layer, n, made)
        head = part_kind(kind, "head")
        self._head = quantized_linear([self._head.weight_matrix()], self._head.bias, head, onednn=None)
        self.quant = kind
        if kind == "w8a8":
            self._choose_int8_kernels()
        return_freed_memory()
        return self

    def new_cache(
        self, batch_size: int, capacity: int, invariant: bool = False, rollback: str | None = None
    ) -> KVCache:
        """A cache for `batch_size` rows of `capacity` tokens. invariant=True: the forwards that
        use it are batch-invariant (models/invariant.py): a token's logits do not depend on how
        many tokens or rows share the forward."""
        c = self.cfg
        if c.linear_layers:
            from .linear_attention import HybridCache

            if invariant:
                raise SpecDecodeError("batch invariance is not implemented for linear-attention layers")
            return HybridCache(
                len(self.kv_index),
                c.linear_layers,
                batch_size,
                c.num_kv_heads,
                c.num_heads,
                capacity,
                c.head_dim,
                self.dtype,
                self.device,
                rollback=rollback or self.rollback,
            )
        return KVCache(
            c.num_layers,
            batch_size,
            c.num_kv_heads,
            capacity,
            c.head_dim,
            self.dtype,
            self.device,
            invariant=invariant,
        )

    @property
    def lm_head(self) -> torch.Tensor:
        """[V, hidden] output projection (the embedding when tied). A quantized model keeps it
        in the file's dtype, mapped; cast to the model's dtype here, once, when a drafter reads it."""
        if self._lm_head.dtype != self.dtype:
            self._lm_head = self._lm_head.to(self.dtype)
        return self._lm_head

    @lm_head.setter
    def lm_head(self, weight: torch.Tensor) -> None:
        self._set_head(weight)

    def _set_head(self, weight: torch.Tensor, pack_from: torch.Tensor | None = None) -> None:
        """`weight` stays the plain [V, hidden] head (the embedding, when tied) for drafters that
        read `lm_head`; the projection keeps its own (packed) copy on CPU, made from `pack_from`
        (a separate copy of the same values) or a clone."""
        self._lm_head = weight
        if weight.device.type != "cpu":
            self._head = Linear(weight)  # F.linear takes the plain one: no second copy
        else:
            self._head = Linear(pack_from if pack_from is not None else weight.clone())

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [..., hidden] -> logits [..., V]."""
        return self._head(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)

    def _rope_tables(self, need: int) -> None:
        if need > self._rope_len:
            # rotate_half(x) * sin == x.roll(D/2) * [-sin, sin]: the sign lives in the table
            self._rope.grow(need)
            self._cos, self._sin, self._rope_len = self._rope.cos, self._rope.sin, len(self._rope)

    # -- riders: forwards of other caches carried through another forward's pass ------------
    def ride(self, tokens: torch.Tensor, cache: KVCache, meta: ForwardMeta, done) -> None:
        """Have tokens [B, T] appended to `cache` by the next forward that can carry them (the
        same layers, one pass over the weights for both: a server's prompt chunk inside the
        running rows' round, as vLLM's chunked prefill batches them); done(logits, hidden) is
        called with this forward's results right after that pass. Only between batch-invariant
        caches (can_carry), where a token's keys, values and logits do not depend on what else
        shares the forward, so carrying changes no bit; flush_riders() runs what was not carried."""
        self.riders.append((tokens, cache, meta, done))

    def can_carry(self, cache, meta: ForwardMeta = PLAIN) -> bool:
        """Whether a forward into `cache` with `meta` may carry riders (and a rider may ride)."""
        return (
            getattr(cache, "invariant", False)
            and type(cache) is KVCache
            and not self.cfg.linear_layers
            and meta.num_layers is None
            and not any(layer.hidden_norm_s is not None for layer in self.layers)
        )

    @torch.inference_mode()
    def flush_riders(self) -> None:
        """Run the riders no forward carried, on their own."""
        riders, self.riders = self.riders, []
        if riders:
            outs = self._forward_calls([(t, c, m) for t, c, m, _ in riders])
            for (*_, done), out in zip(riders, outs):
                done(*out)

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, cache: KVCache, meta: ForwardMeta = PLAIN
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append tokens [B, T] at each row's cache length; return (logits [B, T, V], the
        final-normed hidden states [B, T, hidden] if meta.return_hidden else None, or the aux
        layers' inputs with meta.aux_layers).

        Everything about positions, masks and which attention runs is decided once, before the
        layers, by plan_forward (models/forward_plan.py); this is embed -> blocks -> norm ->
        head, and each block reads the plan. meta (ForwardMeta) covers early exits
        (num_layers), token trees (positions, tree_mask), drafts written past the length
        (offset, advance=False) and EAGLE's fused inputs (inputs_embeds). Riders (ride()) go
        through the same pass when this forward can carry them.
        """
        riders = []
        if self.riders and self.can_carry(cache, meta):
            riders, self.riders = self.riders, []
        outs = self._forward_calls([(tokens, cache, meta), *((t, c, m) for t, c, m, _ in riders)])
        for (*_, done), out in zip(riders, outs[1:]):
            done(*out)
        return outs[0]

    def _forward_calls(self, calls: list) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """forward() for several (tokens, cache, meta) at once: their rows share every
        projection's GEMM (stacked), each attends in its own cache by its own plan."""
        c = self.cfg
        plans = [plan_forward(self, tokens, cache, meta) for tokens, cache, meta in calls]
        xs = [
            (F.embedding(tokens, self.embed).to(self.dtype) if m.inputs_embeds is None else m.inputs_embeds)
            for tokens, _, m in calls
        ]
        xs = [x.reshape(-1, c.hidden_size) for x in xs]
        sizes = [x.shape[0] for x in xs]
        x = xs[0] if len(xs) == 1 else torch.cat(xs)
        jobs = [(tokens, cache, plan) for (tokens, cache, _), plan in zip(calls, plans)]
        aux_at = set().union(*(p.aux_layers for p in plans))
        aux: dict[int, torch.Tensor] = {}  # layer index -> the residual stream entering it
        head = plans[0]  # the layers, invariance and eps every call shares (can_carry)
        fused = head.invariant and self.fused_layers
        layers = head.layers
        if fused and self.layers_in_c and len(jobs) == 1 and not aux_at:
            x, layers = _c_layers(self, x, jobs[0], len(layers)), []
        for i, layer in enumerate(layers):
            if i in aux_at:
                aux[i] = x
            if fused:
                x = _fused_attention_block(self, i, layer, x, jobs, sizes)
            elif layer.linear:
                tokens, cache, plan = jobs[0]
                x = _linear_attention_block(self, i, layer, x, tokens, cache, plan)
            else:
                x = _attention_block(self, i, layer, x, jobs, sizes)
        aux[len(head.layers)] = x  # the last layer's output, before the final norm
        for (tokens, cache, _), plan in zip(jobs, plans):
            if plan.advance:
                cache.advance(tokens.shape[1])
        x = _rms_norm(x, self._final_norm_s, head.d_eps, head.invariant)
        outs, start = [], 0
        for (tokens, _, meta), plan, n in zip(calls, plans, sizes):
            outs.append(self._outputs(x.narrow(0, start, n), tokens.shape, meta, plan, aux, start, n))
            start += n
        return outs

    def _outputs(self, x, shape, meta: ForwardMeta, plan: ForwardPlan, aux: dict, start: int, n: int):
        """One call's (logits, hidden) from its rows x [B * T, hidden] of the final-normed stream
        (rows start .. start + n of the pass's)."""
        B, T = shape
        hidden = x.view(B, T, -1) if meta.return_hidden else None
        if plan.aux_layers:
            if not all(i in aux for i in plan.aux_layers):
                raise SpecDecodeError(f"aux layers {plan.aux_layers} are not all in 0..{len(plan.layers)}")
            hidden = torch.cat([aux[i].narrow(0, start, n) for i in plan.aux_layers], -1).view(B, T, -1)
        if not meta.need_logits:
            return None, hidden
        if meta.logits_at is not None and T > 1:  # only the positions asked for
            x = x.view(B, T, -1)[torch.arange(B, device=x.device), meta.logits_at]
            return self._head(x, invariant=plan.invariant).view(B, 1, -1), hidden
        return self._head(x, invariant=plan.invariant).view(B, T, -1), hidden


def _mlp(model: LlamaModel, layer: _Layer, x: torch.Tensor, plan: ForwardPlan) -> torch.Tensor:
    """The SwiGLU half of a block, residual included."""
    inv, inter = plan.invariant, model.cfg.intermediate_size
    h = _rms_norm(x, layer.mlp_norm_s, plan.d_eps, inv)
    gate_up = layer.gate_up(h, invariant=inv)
    if inv and not _splits_whole_vectors(gate_up.shape[0], inter):
        act = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
        step = max(1, (_GRAIN - 1) // inter)  # rows that torch runs on one thread
        for r in range(0, gate_up.shape[0], step):
            g = gate_up[r : r + step]
            torch.mul(F.silu(g[:, :inter]), g[:, inter:], out=act[r : r + step])
    else:
        act = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
    return layer.down(act, residual=x, invariant=inv)


# torch runs an elementwise op over this many elements or more on several threads (at::internal::
# GRAIN_SIZE), each thread a contiguous share of the flattened rows; a share's last elements
# that fill no whole vector take the scalar code, and silu's scalar exp is not the vectorized one
# bit for bit. Where a share ends mid-row at other than a multiple of 32 elements, that row's
# silu would depend on how many rows share the forward (a 688-wide MLP, odd row counts, 2
# threads: the KV self-check found it); then the rows go in slices that each run on one thread.
_GRAIN = 32768


def _splits_whole_vectors(rows: int, width: int) -> bool:
    """Whether torch's split of an elementwise op over rows x width elements between its threads
    falls at a multiple of 32 elements into a row at every boundary (or does not split)."""
    n = rows * width
    tasks = min(torch.get_num_threads(), -(-n // _GRAIN))
    if tasks <= 1:
        return True
    chunk = -(-n // tasks)
    return all((j * chunk) % width % 32 == 0 for j in range(1, tasks))


def _attention_block(model: LlamaModel, i: int, layer: _Layer, x, jobs, sizes):
    """One decoder layer with softmax attention over the rows x of one or more forwards (jobs:
    (tokens, cache, plan) each, sizes: their rows in x): norm and q|k|v for all rows at once
    (Qwen2's biases live in the projection; EAGLE-3's input layer reads the token's embedding
    beside the fed feature), then per forward Qwen3's per-head q/k norms, RoPE, the cache write
    and attention as its plan says; the output projection and MLP for all rows again."""
    c, inv, d_eps = model.cfg, jobs[0][2].invariant, jobs[0][2].d_eps
    H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
    if layer.hidden_norm_s is None:
        h = _rms_norm(x, layer.attn_norm_s, d_eps, inv)
    else:  # EAGLE-3 (one forward): the token's embedding beside the fed feature
        e = F.embedding(jobs[0][0], model.embed).to(model.dtype).reshape(-1, c.hidden_size)
        h = torch.cat(
            [_rms_norm(e, layer.attn_norm_s, d_eps, inv), _rms_norm(x, layer.hidden_norm_s, d_eps, inv)], -1
        )
    qkv_all = layer.qkv(h, invariant=inv)
    kv = model.kv_index[i]
    if inv and layer.qk_norm_s is None and model.kernel_attention:
        attn = _kernel_rope_attention(qkv_all, kv, jobs, sizes).to(model.dtype)
        x = layer.o(attn, residual=x, invariant=inv)
        return _mlp(model, layer, x, jobs[0][2])
    outs, start = [], 0
    for (tokens, cache, plan), n in zip(jobs, sizes):
        B, T = tokens.shape
        qkv = (qkv_all if len(jobs) == 1 else qkv_all.narrow(0, start, n)).view(B, T, H + 2 * Hkv, D)
        start += n
        qk = qkv[:, :, : H + Hkv]
        if layer.qk_norm_s is not None:  # qwen3: each head's query and key normed over D
            qk = _rms_norm(qk, layer.qk_norm_s, D * c.rms_norm_eps, inv)
        qk = torch.addcmul(qk * plan.cos, qk.roll(D // 2, -1), plan.sin)  # RoPE on q and k at once
        k, v = qk[:, :, H:].transpose(1, 2), qkv[:, :, H + Hkv :].transpose(1, 2)  # [B, Hkv, T, D]
        keys, values = plan.write_kv(cache.layer_k[kv], cache.layer_v[kv], k, v)
        outs.append(plan.attend(qk[:, :, :H], keys, values, cache.layer_k[kv], cache.layer_v[kv]))
    attn = outs[0] if len(outs) == 1 else torch.cat(outs)
    x = layer.o(attn, residual=x, invariant=inv)
    return _mlp(model, layer, x, jobs[0][2])


def _kernel_rope_attention(qkv_all: torch.Tensor, kv: int, jobs, sizes) -> torch.Tensor:
    """RoPE, the cache write and the attention of every forward in `jobs` from their q|k|v rows,
    one C call a forward (kernels.rope_attention, in float32: a bf16 model's rows and tables are
    widened exactly) -> [rows, H * D] float32. The batch-invariant forward of a model on the
    kernel's attention takes it, fused layers or not."""
    from ..kernels import rope_attention

    qkv_all = qkv_all.float()
    outs, start = [], 0
    for (_, cache, plan), n in zip(jobs, sizes):
        qkv = qkv_all if len(jobs) == 1 else qkv_all.narrow(0, start, n)
        start += n
        a = plan.attention
        checked = a.tables is not None  # the first layer of a forward checks its arguments
        if not checked:  # once a forward, not a layer
            a.tables = tuple(t if t.dtype == torch.float32 else t.float() for t in (plan.cos, plan.sin))
        cos, sin = a.tables
        keys, values = cache.layer_k[kv], cache.layer_v[kv]
        outs.append(
            rope_attention(
                qkv, plan.shape, cos, sin, keys, values, a.slots, a.idx, a.n, a.scale, checked=checked
            )
        )
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _fused_attention_block(model: LlamaModel, i: int, layer: _Layer, x, jobs, sizes):
    """_attention_block for a model with fused_layers, in five C calls (kernels/): the input norm
    inside the q|k|v product (biases in its epilogue), RoPE + cache write + attention per forward,
    the output projection with the residual added, the MLP norm inside gate|up, SwiGLU inside the
    down projection with the residual added. Each is computed row by row in a fixed order, so a
    token's bits do not depend on what shares the forward."""
    from .kernel_linear import fused_product

    d_eps = jobs[0][2].d_eps
    qkv_all = fused_product(layer.qkv, x, "rms_norm", layer.attn_norm_s, d_eps)
    attn = _kernel_rope_attention(qkv_all, model.kv_index[i], jobs, sizes)
    x = fused_product(layer.o, attn, residual=x)
    gate_up = fused_product(layer.gate_up, x, "rms_norm", layer.mlp_norm_s, d_eps)
    return fused_product(layer.down, gate_up, "swiglu", residual=x)


def _c_layers(model: LlamaModel, x: torch.Tensor, job, count: int) -> torch.Tensor:
    """The first `count` layers as _fused_attention_block runs them, in one C call
    (kernels.layers) over the one forward `job`; the stream x is not modified."""
    from ..kernels import layers

    _, cache, plan = job
    a = plan.attention
    if a.tables is None:  # as _kernel_rope_attention: float32 tables, once a forward
        a.tables = tuple(t if t.dtype == torch.float32 else t.float() for t in (plan.cos, plan.sin))
    caches = [(cache.layer_k[model.kv_index[i]], cache.layer_v[model.kv_index[i]]) for i in range(count)]
    table, widths = _layer_table(model)
    return layers(
        table, count, x, plan.d_eps, widths, plan.shape, *a.tables, caches, a.slots, a.idx, a.n, a.scale
    )


def _layer_table(model: LlamaModel) -> tuple[torch.Tensor, tuple[int, int]]:
    """kernels.layers' table of the model's layers (built once; built again if a layer's
    projections or norms were replaced), and (hidden, gate|up outputs)."""
    from ..kernels import LAYER_WORDS, projection_words
    from .kernel_linear import projection_parts

    parts = [(la.qkv, la.o, la.gate_up, la.down, la.attn_norm_s, la.mlp_norm_s) for la in model.layers]
    known = getattr(model, "_c_table", None)
    if known is not None and all(p is q for a, b in zip(known[0], parts) for p, q in zip(a, b)):
        return known[1], known[2]
    hidden = model.cfg.hidden_size
    widths = (hidden, parts[0][2].out_features)
    rows = []
    for *projs, attn_norm, mlp_norm in parts:
        for norm in (attn_norm, mlp_norm):
            if norm.dtype != torch.float32 or norm.shape != (hidden,) or not norm.is_contiguous():
                raise SpecDecodeError("fused layers need float32 norm weights of the hidden width")
        if projs[2].out_features != widths[1]:
            raise SpecDecodeError("fused layers in one call need one gate|up width in every layer")
        row = [w for p in projs for w in projection_words(projection_parts(p))]
        rows.append(row + [attn_norm.data_ptr(), mlp_norm.data_ptr()])
    table = torch.tensor(rows, dtype=torch.int64).view(-1, LAYER_WORDS)
    model._c_table = (parts, table, widths)  # the parts keep every tensor the table points to alive
    return table, widths


def _linear_attention_block(model: LlamaModel, i: int, layer: _Layer, x, tokens, cache, plan: ForwardPlan):
    """One gated delta-rule layer of a hybrid model (models/linear_attention.py), then its MLP."""
    from .linear_attention import linear_attention_inputs

    c, inv = model.cfg, plan.invariant
    B, T = tokens.shape
    h = _rms_norm(x, layer.attn_norm_s, plan.d_eps, inv)
    q, k, v, a, b = linear_attention_inputs(layer.qkv(h), B, T, c.num_heads, c.head_dim, cache.state_dtype)
    out = cache.run_layer(i, q, k, v, a, b, plan.parents, plan.advance, plan.offset)
    attn = out.to(model.dtype).reshape(B * T, c.num_heads * c.head_dim)
    x = layer.o(attn, residual=x, invariant=inv)
    return _mlp(model, layer, x, plan)
