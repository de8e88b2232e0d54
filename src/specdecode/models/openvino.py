"""OpenVINO as an engine behind the CausalLM contract (`backend="openvino"`).

The graph is built with OpenVINO's own operation API from our converted checkpoint (the same
Llama / Qwen2 / Qwen3 weights our lean runtime reads; no export tool, no hub, no torch or
transformers version of its own), its projections compressed as OpenVINO's CPU plugin expects
them (an int8 or int4 constant, a Convert, a Multiply by per-row or per-group scales: the
plugin fuses that into one weight-decompressing matmul), saved once as OpenVINO IR under the
model cache and compiled from there.

The key/value cache lives outside the graph, in arrays we own: each forward takes the past keys
and values of every layer as inputs ([B, L, kv_heads, head_dim]) and returns only the new
tokens' ones, which we write at each row's length. Rolling a rejected draft back is therefore
setting a length (no copy of the state; OpenVINO's stateful KV variables would need a read,
slice and write of the whole state per round). Positions (RoPE) and the attention mask are
inputs too, so rows may be ragged, and a forward may ask for the logits of chosen positions
only (a prefill needs one).

What it does not do, declared as capabilities and refused with one line: token trees, drafts
written past the length, early exits, hidden states (EAGLE, Medusa) and batch invariance (the
plugin's kernels take other paths for other numbers of rows, so greedy speculative output may
leave target-only's where two logits nearly tie).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

from ..errors import SpecDecodeError
from ..formats import FORMATS, OPENVINO_FORMATS
from ..progress import bar
from .base import PLAIN, ForwardMeta
from .llama import LlamaConfig, _LazyWeights
from .quant import QUANT_KINDS
from .rope import RopeTables
from .tokenizer import TextTokenizer

# weight format (formats.py rows with openvino=True) -> (bits or the float constants' type, group
# size; None: one scale per output row)
OV_FORMATS: dict[str, tuple] = {
    n: ({"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[FORMATS[n].activations], None)
    if FORMATS[n].quant is None
    else QUANT_KINDS[FORMATS[n].quant]
    for n in OPENVINO_FORMATS
}
GRAPH_VERSION = 1  # bump when the graph below changes: cached IR of another version is rebuilt
NEG = -1e30  # a masked score (finite: a row of all-masked padding stays finite)


def need_openvino():
    """The openvino module, or one line saying how to install it."""
    try:
        import openvino

        return openvino
    except ImportError:
        raise SpecDecodeError(
            "backend 'openvino' needs the openvino package: pip install 'specdecode[openvino]'"
        ) from None


# -- weights in OpenVINO's compressed forms ------------------------------------------------------


def quantize_sym(w: np.ndarray, bits: int, group: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric round-to-nearest quantization of a float32 [out, in] weight, OpenVINO's
    compressed layout: int8 (q int8 [out, in], scales [out, 1]) or int4 in groups (q in -8..7
    [out, in / group, group], scales [out, in / group, 1]); w ~ q * s. The scale maps the
    group's largest magnitude to -8 (int4) or 127 (int8)."""
    if bits == 8:
        s = np.abs(w).max(1, keepdims=True) / 127
        s = np.maximum(s, 1e-10).astype(np.float32)
        return np.clip(np.rint(w / s), -128, 127).astype(np.int8), s
    out, inp = w.shape
    if inp % group:
        raise SpecDecodeError(f"int4 in groups of {group} needs input widths divisible by {group}, got {inp}")
    wg = w.reshape(out, inp // group, group)
    s = np.abs(wg).max(-1, keepdims=True) / 8
    s = np.maximum(s, 1e-10).astype(np.float32)
    return np.clip(np.rint(wg / s), -8, 7).astype(np.int8), s


def default_format(path: Path) -> str:
    """The format the openvino backend runs a checkpoint in when none is given: int4 in groups of
    128 (on the 1.5B its one-token step and its verification measured fastest of OpenVINO's
    formats, docs/openvino.md) where every projection's input width is whole groups of 128, else
    of 32, else int8."""
    cfg = LlamaConfig.from_dict(json.loads((path / "config.json").read_text()))
    widths = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
    for fmt in ("int4-g128", "int4"):
        if all(w % OV_FORMATS[fmt][1] == 0 for w in widths):
            return fmt
    return "int8"


def dequantize_sym(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The float32 [out, in] matrix quantize_sym's integers stand for."""
    return (q.astype(np.float32) * s).reshape(q.shape[0], -1)


def _i4_constant(q: np.ndarray):
    """An OpenVINO i4 constant of int8 values in -8..7 (two per byte, low nibble first)."""
    ov = need_openvino()
    t = ov.Tensor(ov.Type.i4, list(q.shape))
    u = (q.reshape(-1) & 0xF).astype(np.uint8)
    t.data[:] = (u[0::2] | (u[1::2] << 4)).view(np.int8)
    return ov.op.Constant(t)


def _weight(w: np.ndarray, fmt: str):
    """The graph node of a float32 [out, in] weight in `fmt`, as a float32 [out, in] output."""
    ov = need_openvino()
    import openvino.opset13 as ops

    kind, group = OV_FORMATS[fmt]
    if kind == "f32":
        return ops.constant(np.ascontiguousarray(w, np.float32))
    if kind in ("bf16", "f16"):
        t = torch.from_numpy(w).to(torch.bfloat16 if kind == "bf16" else torch.float16)
        tensor = ov.Tensor(ov.Type.bf16 if kind == "bf16" else ov.Type.f16, list(w.shape))
        tensor.data.view(np.uint16)[:] = t.view(torch.int16).numpy().view(np.uint16)  # the bits as they are
        return ops.convert(ov.op.Constant(tensor), ov.Type.f32)
    q, s = quantize_sym(w, kind, group)
    if kind == 8:
        return ops.multiply(ops.convert(ops.constant(q), ov.Type.f32), ops.constant(s))
    deq = ops.multiply(ops.convert(_i4_constant(q), ov.Type.f32), ops.constant(s))
    return ops.reshape(deq, ops.constant(np.array(w.shape, np.int64)), False)


# -- the graph -----------------------------------------------------------------------------------


def build_graph(cfg: LlamaConfig, weights, fmt: str, progress: bool = True):
    """An ov.Model of the decoder in `fmt`. Inputs: input_ids [B, T], cos / sin [B, T, D]
    (RoPE at each token's position), mask [B, T, L + T] (0 or NEG: which past slots and new
    tokens each new token sees), logits_at [B, S] (the positions whose logits come back) and
    past_k.i / past_v.i [B, L, kv_heads, D] per layer. Outputs: logits [B, S, V] and the new
    tokens' present_k.i / present_v.i [B, T, kv_heads, D]."""
    ov = need_openvino()
    import openvino.opset13 as ops

    f32, i64 = ov.Type.f32, ov.Type.i64
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = H // Hkv

    def arr(name: str) -> np.ndarray:
        return weights[name].float().numpy()

    def c64(*v):
        return ops.constant(np.array(v, np.int64))

    def dense(x, names: list[str], bias_names: list[str] | None = None):
        w = np.concatenate([arr(n) for n in names])
        y = ops.matmul(x, _weight(w, fmt), False, True)
        if bias_names and all(n in weights for n in bias_names):
            y = ops.add(y, ops.constant(np.concatenate([arr(n) for n in bias_names])))
        return y

    def rms(x, w: np.ndarray, eps: float):
        var = ops.reduce_mean(ops.multiply(x, x), c64(-1), True)
        return ops.multiply(
            ops.divide(x, ops.sqrt(ops.add(var, ops.constant(np.float32(eps))))), ops.constant(w)
        )

    def rope(x, cos, sin):  # x [B, T, heads, D]; cos, sin [B, T, 1, D]
        lo, hi = ops.variadic_split(x, c64(-1), c64(D // 2, D // 2)).outputs()
        rotated = ops.concat([ops.negative(hi), lo], -1)
        return ops.add(ops.multiply(x, cos), ops.multiply(rotated, sin))

    ids = ops.parameter([-1, -1], i64, name="input_ids")
    cos_in = ops.parameter([-1, -1, D], f32, name="cos")
    sin_in = ops.parameter([-1, -1, D], f32, name="sin")
    mask_in = ops.parameter([-1, -1, -1], f32, name="mask")
    at_in = ops.parameter([-1, -1], i64, name="logits_at")
    params = [ids, cos_in, sin_in, mask_in, at_in]
    cos, sin = ops.unsqueeze(cos_in, c64(2)), ops.unsqueeze(sin_in, c64(2))
    mask = ops.unsqueeze(mask_in, c64(1, 2))  # [B, 1, 1, T, L + T]

    embed_name = "model.embed_tokens.weight"
    head_name = (
        "lm_head.weight" if "lm_head.weight" in weights and not cfg.tie_word_embeddings else embed_name
    )
    embed = arr(embed_name)
    if OV_FORMATS[fmt][0] in (4, 8):  # the table the lookups read: int8 per row
        q, s = quantize_sym(embed, 8, None)
        table = ops.multiply(ops.convert(ops.constant(q), f32), ops.constant(s))
    else:
        table = _weight(embed, fmt)
    x = ops.gather(table, ids, 0)  # [B, T, d]
    del embed
    results = []
    for i in bar(range(cfg.num_layers), "building the OpenVINO graph", enabled=progress):
        p = f"model.layers.{i}."
        past_k = ops.parameter([-1, -1, Hkv, D], f32, name=f"past_k.{i}")
        past_v = ops.parameter([-1, -1, Hkv, D], f32, name=f"past_v.{i}")
        params += [past_k, past_v]
        h = rms(x, arr(p + "input_layernorm.weight"), cfg.rms_norm_eps)
        names = [p + f"self_attn.{n}_proj" for n in "qkv"]
        qkv = dense(h, [n + ".weight" for n in names], [n + ".bias" for n in names])
        qkv = ops.reshape(qkv, c64(0, 0, H + 2 * Hkv, D), True)
        q, k, v = ops.variadic_split(qkv, c64(2), c64(H, Hkv, Hkv)).outputs()
        if cfg.qk_norm:
            q = rms(q, arr(p + "self_attn.q_norm.weight"), cfg.rms_norm_eps)
            k = rms(k, arr(p + "self_attn.k_norm.weight"), cfg.rms_norm_eps)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        results += [ops.result(k, name=f"present_k.{i}"), ops.result(v, name=f"present_v.{i}")]
        keys = ops.transpose(ops.concat([past_k, k], 1), c64(0, 2, 1, 3))  # [B, Hkv, L + T, D]
        values = ops.transpose(ops.concat([past_v, v], 1), c64(0, 2, 1, 3))
        keys, values = ops.unsqueeze(keys, c64(2)), ops.unsqueeze(values, c64(2))  # [B, Hkv, 1, S, D]
        q = ops.reshape(q, c64(0, 0, Hkv, G, D), True)
        q = ops.transpose(ops.multiply(q, ops.constant(np.float32(D**-0.5))), c64(0, 2, 3, 1, 4))
        scores = ops.add(ops.matmul(q, keys, False, True), mask)  # [B, Hkv, G, T, S]
        attn = ops.matmul(ops.softmax(scores, -1), values, False, False)  # [B, Hkv, G, T, D]
        attn = ops.reshape(ops.transpose(attn, c64(0, 3, 1, 2, 4)), c64(0, 0, H * D), True)
        x = ops.add(x, dense(attn, [p + "self_attn.o_proj.weight"], [p + "self_attn.o_proj.bias"]))
        h = rms(x, arr(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
        gate_up = dense(h, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        gate, up = ops.variadic_split(
            gate_up, c64(-1), c64(cfg.intermediate_size, cfg.intermediate_size)
        ).outputs()
        x = ops.add(x, dense(ops.multiply(ops.swish(gate), up), [p + "mlp.down_proj.weight"]))
    x = rms(x, arr("model.norm.weight"), cfg.rms_norm_eps)
    x = ops.gather(x, at_in, 1, 1)  # [B, S, d]: the positions asked for
    logits = ops.matmul(x, _weight(arr(head_name), fmt), False, True)
    results.insert(0, ops.result(logits, name="logits"))
    return ov.Model(results, params, "specdecode-decoder")


# -- the cache and the model ---------------------------------------------------------------------


class OVCache:
    """Each layer's keys and values [B, capacity, kv_heads, D] in float32 arrays we own, and
    each row's length. Rewinding sets the lengths (the slots past them are overwritten later)."""

    def __init__(self, layers: int, batch_size: int, capacity: int, kv_heads: int, head_dim: int) -> None:
        shape = (batch_size, capacity, kv_heads, head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long)
        self.capacity = capacity

    def rewind(self, lengths: torch.Tensor) -> None:
        lengths = lengths.to(torch.long)
        if bool((lengths > self.lengths).any()) or bool((lengths < 0).any()):
            raise ValueError("rewind can only shorten rows")
        self.lengths = lengths.clone()

    def select_rows(self, rows: torch.Tensor) -> None:
        idx = rows.cpu().numpy()
        self.k = [a[idx] for a in self.k]
        self.v = [a[idx] for a in self.v]
        self.lengths = self.lengths[rows].clone()

    def reserve_for(self, other) -> None:  # joins copy the rows (nothing to prepare)
        pass

    def tick(self) -> None:
        pass

    def add_rows(self, other: OVCache) -> None:
        if other.capacity != self.capacity:
            raise ValueError("add_rows: the caches' capacities differ")
        self.k = [np.concatenate([a, b]) for a, b in zip(self.k, other.k)]
        self.v = [np.concatenate([a, b]) for a, b in zip(self.v, other.v)]
        self.lengths = torch.cat([self.lengths, other.lengths])


class OVModel:
    """A Llama, Qwen2 or Qwen3 checkpoint compiled by OpenVINO for the CPU: forward(tokens
    [B, T], cache, meta) -> (float32 logits [B, T, V], None)."""

    # capabilities: plain causal chains; no trees, offsets, early exit, hidden states, invariance
    lean = False
    supports_invariant = False
    hybrid = False

    def __init__(self, cfg: LlamaConfig, compiled, fmt: str, n_params: int) -> None:
        self.cfg = cfg
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self.quant = fmt
        self._n_params = n_params
        self.dtype = torch.float32  # the logits' type
        self.device = torch.device("cpu")
        self.vocab_size = cfg.vocab_size
        self.max_positions: int | None = None
        self.name = ""
        self.path = Path()
        self.tokenizer: TextTokenizer | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self._tables = RopeTables(cfg.rope_theta, cfg.head_dim, torch.float32, signed=False)
        self._rope_len = 0
        self._cos = self._sin = np.zeros((0, cfg.head_dim), np.float32)

    @staticmethod
    def from_dir(
        path: Path,
        fmt: str = "int4-g128",
        cache: Path | None = None,
        label: str | None = None,
        precision: str | None = None,
        progress: bool = True,
    ) -> OVModel:
        """Build the graph of the checkpoint in `path` in `fmt` (OV_FORMATS) and compile it for
        the CPU with torch's thread count. cache: a directory where the graph is saved as IR
        (`<label>-<fmt>-<key>.xml`, the key hashing the checkpoint, the format and the versions)
        and read back next time. precision: the activations' type inside the plugin ("f32",
        "bf16"; default: f32 for fp32 weights, else the plugin's own choice: bf16 where the CPU
        has it)."""
        ov = need_openvino()
        if fmt not in OV_FORMATS:
            raise SpecDecodeError(
                f"the openvino backend runs {', '.join(OV_FORMATS)}, not {fmt!r} "
                "(for w8a8 use int8: OpenVINO quantizes the activations itself)"
            )
        try:
            cfg = LlamaConfig.from_dict(json.loads((path / "config.json").read_text()))
        except (NotImplementedError, KeyError) as e:
            raise SpecDecodeError(f"{path}: the openvino backend cannot build this model ({e})") from None
        if cfg.linear_layers:
            raise SpecDecodeError(f"{path}: the openvino backend has no linear-attention layers")
        weights = _LazyWeights(path)
        n_params = sum(weights.stored(n).numel() for n in weights)
        core = _core()
        xml = None
        if cache is not None:
            prefix = f"{label or path.name}.{fmt}."  # no format name holds a dot
            xml = cache / f"{prefix}{_graph_key(path, fmt)}.xml"
        if xml is not None and xml.exists():
            model = core.read_model(str(xml))
        else:
            print(
                f"specdecode: building the OpenVINO graph of {label or path.name} in {fmt} (once)",
                file=sys.stderr,
            )
            model = build_graph(cfg, weights, fmt, progress)
            if xml is not None:
                try:
                    xml.parent.mkdir(parents=True, exist_ok=True)
                    for old in xml.parent.glob(prefix + "*"):  # another checkpoint or version's graph
                        old.unlink()
                    ov.save_model(model, str(xml), compress_to_fp16=False)
                except OSError as e:
                    raise SpecDecodeError(
                        f"cannot write {xml.parent}: {e.strerror}; set SPECDECODE_CACHE to a writable "
                        "directory"
                    ) from None
        config = {
            "INFERENCE_NUM_THREADS": threads(),
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
        }
        precision = precision or ("f32" if fmt == "fp32" else None)
        if precision is not None:
            config["INFERENCE_PRECISION_HINT"] = precision
        if precision == "f32":  # and no int8 activations inside compressed matmuls either
            config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
        out = OVModel(cfg, core.compile_model(model, "CPU", config), fmt, n_params)
        # the plugin repacks the weights at the first inference (5.7 s on the 1.5B): done here, at
        # load, so that no request's first token pays it
        out.forward(torch.zeros(1, 1, dtype=torch.long), out.new_cache(1, 1))
        return out

    def num_parameters(self) -> int:
        return self._n_params

    def new_cache(self, batch_size: int, capacity: int, invariant: bool = False, rollback=None) -> OVCache:
        if invariant:
            raise SpecDecodeError("batch invariance needs our lean runtime; drop --backend openvino")
        c = self.cfg
        return OVCache(c.num_layers, batch_size, capacity, c.num_kv_heads, c.head_dim)

    def _rope(self, need: int) -> None:
        if need > self._rope_len:  # our runtime's values (rope.py); the graph rotates the halves
            self._tables.grow(need)
            self._cos, self._sin = self._tables.cos.numpy(), self._tables.sin.numpy()
            self._rope_len = len(self._tables)

    def forward(
        self, tokens: torch.Tensor, cache: OVCache, meta: ForwardMeta = PLAIN
    ) -> tuple[torch.Tensor | None, None]:
        special = (meta.tree_mask, meta.positions, meta.num_layers, meta.inputs_embeds, meta.aux_layers)
        if any(x is not None for x in special) or meta.offset or not meta.advance or meta.return_hidden:
            raise SpecDecodeError(
                "token trees, early exit and EAGLE / Medusa heads need our lean runtime; "
                "drop --backend openvino"
            )
        B, T = tokens.shape
        lengths = cache.lengths.numpy()
        L = int(lengths.max())
        if int(lengths.max()) + T > cache.capacity:
            raise ValueError(f"cache overflow: {L} + {T} tokens > capacity {cache.capacity}")
        pos = lengths[:, None] + np.arange(T)[None, :]  # [B, T]
        self._rope(int(pos.max()) + 1)
        mask = np.full((B, T, L + T), NEG, np.float32)
        mask[:, :, :L][np.broadcast_to(np.arange(L)[None, None, :] < lengths[:, None, None], (B, T, L))] = 0
        mask[:, :, L:][np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T))] = 0
        if meta.logits_at is not None and T > 1:
            at = meta.logits_at.numpy().reshape(B, 1).astype(np.int64)
        elif not meta.need_logits:
            at = np.full((B, 1), T - 1, np.int64)
        else:
            at = np.broadcast_to(np.arange(T, dtype=np.int64), (B, T))
        inputs = {
            "input_ids": tokens.numpy().astype(np.int64),
            "cos": self._cos[pos],
            "sin": self._sin[pos],
            "mask": mask,
            "logits_at": np.ascontiguousarray(at),
        }
        for i in range(self.cfg.num_layers):
            inputs[f"past_k.{i}"] = np.ascontiguousarray(cache.k[i][:, :L])
            inputs[f"past_v.{i}"] = np.ascontiguousarray(cache.v[i][:, :L])
        out = self.request.infer(inputs, share_inputs=True, share_outputs=True)
        rows = np.arange(B)[:, None]
        for i in range(self.cfg.num_layers):
            cache.k[i][rows, pos] = out[f"present_k.{i}"]
            cache.v[i][rows, pos] = out[f"present_v.{i}"]
        cache.lengths = cache.lengths + T
        if not meta.need_logits:
            return None, None
        return torch.from_numpy(np.array(out["logits"], np.float32)), None


_CORE = None
_THREADS: int | None = None


def threads() -> int:
    """The threads every OpenVINO model of this process runs on: torch's count when the first one
    is compiled (the front ends then give torch's own ops one thread: specdecode.open)."""
    global _THREADS
    if _THREADS is None:
        _THREADS = torch.get_num_threads()
    return _THREADS


def _core():
    """One OpenVINO Core per process: its CPU plugin, and with it one pool of threads, is shared
    by every model compiled here (a target and its draft alternate; two pools would spin against
    each other on the same cores)."""
    global _CORE
    if _CORE is None:
        _CORE = need_openvino().Core()
    return _CORE


def _graph_key(path: Path, fmt: str) -> str:
    """A name for the IR of this checkpoint in this format: the config, the weight files' names,
    sizes and times, the graph's version and OpenVINO's."""
    ov = need_openvino()
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(f"{fmt}:{GRAPH_VERSION}:{ov.__version__}".encode())
    return h.hexdigest()[:16]
