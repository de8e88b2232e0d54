"""One path from options to a running generator: `specdecode.open(target, draft=..., ...)`.

`generate`, `serve`, `bench`, the demo and benchmarks/ all come through here, so the rules live in
one place: which weight format each model runs in (`dtype="auto"`: measured, autotune.py), which
drafter a method needs, that `draft_dtype` needs a drafter, and that a speculative run on our lean
runtime is batch-invariant unless the caller opts out (greedy output then equals target-only token
for token, whatever the format).

    from specdecode import open as sd_open, SamplingParams
    gen = sd_open("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b")   # formats chosen by measuring
    gen.choice.line()        # 'specdecode: formats: target w8a8 (...), draft int4 (...); ...'
    gen.generate([[{"role": "user", "content": "..."}]], SamplingParams(temperature=0))
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .autotune import TARGET_CANDIDATES, Choice, Shapes, choose
from .core.config import SpecConfig
from .errors import SpecDecodeError
from .formats import AUTO, BACKENDS, FORMATS, check_format, weight_format
from .models.draft_vocab import FALLBACK, FULL, vocab_size

HEAD_METHODS = ("eagle", "eagle3", "medusa", "auto")  # methods whose drafter has weights of its own


# known models whose default format is measured (weights dominate their step, and their GGUF
# is already 4-bit, so an 8- or 4-bit format keeps what the file holds); SmolLM2-135M keeps bf16:
# re-quantized to 4 bits it answered "What is the capital of France?" without "Paris" (test_serve)
AUTO_BY_DEFAULT = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
DEFAULT_FORMATS = {"smollm2-135m": "bf16"}


def default_dtype(target: str) -> str:
    """The target's format when none is given: auto (measured) for the Qwen2.5-Coder pair and any
    .gguf file (already quantized: an 8- or 4-bit format, kq its own blocks, keeps what it holds);
    bf16 for smollm2-135m; fp32 for the bundled tiny models and local directories (pass
    dtype='auto' to measure any of them)."""
    if str(target) in AUTO_BY_DEFAULT or str(target).lower().endswith(".gguf"):
        return AUTO
    return DEFAULT_FORMATS.get(str(target), "fp32")


def check_draft_dtype(draft_dtype: str | None, draft: str | None, method: str | None) -> None:
    """draft_dtype needs something that drafts with weights: a draft model or trained heads."""
    if draft_dtype not in (None, AUTO) and not draft and method not in HEAD_METHODS:
        raise SpecDecodeError(
            "--draft-dtype needs --draft MODEL (or a method with trained heads: eagle, eagle3, medusa)"
        )
    if draft_dtype is not None:
        check_format(draft_dtype, "draft dtype", draft=True)


def _lean_shapes(name: str, backend: str) -> Shapes | None:
    """The projection shapes of a model our lean runtime will run (None: it will not)."""
    import torch

    from .models import resolve
    from .models.llama import LlamaConfig

    if backend in ("hf", "openvino"):
        return None
    path = resolve(name, torch.bfloat16)
    try:
        cfg = LlamaConfig.from_dict(json.loads((path / "config.json").read_text()))
    except (NotImplementedError, KeyError, json.JSONDecodeError):
        return None
    if cfg.linear_layers:  # hybrid layers: quantized linear attention is not measured
        return None
    from .models import gguf_source
    from .models.gguf_quant import narrow_kind

    try:
        gguf = gguf_source(name)
    except SpecDecodeError:
        gguf = None
    return Shapes.of(cfg, narrow_kind(gguf) if gguf is not None else "q8_0")


def _kernel_of(fmt: str) -> str:
    """The measured format whose kernel a format runs (a GGUF's Q4_K / Q8_0 blocks: int4 / int8)."""
    return {"q4_k": "int4", "q8_0": "int8"}.get(fmt, fmt)


def _pinned_draft(draft_dtype: str | None, target_format: str, lean: bool, backend: str = "auto") -> str:
    """A draft model's format when it is not measured: as asked, else the target's (as a draft can
    run it: a GGUF's blocks belong to the target; transformers runs float formats only; OpenVINO
    runs the target's format)."""
    if draft_dtype not in (None, AUTO):
        return draft_dtype
    if backend == "openvino":
        return target_format
    if FORMATS[target_format].gguf or (not lean and FORMATS[target_format].quant is not None):
        return "bf16" if lean else "fp32"
    return target_format


def _check_openvino(dtype: str, draft_dtype: str | None, batch_invariant: bool | None, config) -> None:
    """One line before anything loads when the openvino backend cannot do what was asked."""
    from .formats import OPENVINO_FORMATS

    lean_only = {
        "--tree": config.tree is not None,
        f"--method {config.method}": config.method in ("eagle", "eagle3", "medusa", "early-exit"),
        "--draft-vocab": config.draft_vocab not in (None, FULL),
    }
    for flag, asked in lean_only.items():
        if asked:
            raise SpecDecodeError(f"{flag} needs our lean runtime: drop --backend openvino")
    if batch_invariant:
        raise SpecDecodeError(
            "batch invariance needs our lean runtime: drop --batch-invariant or --backend openvino"
        )
    for fmt in (dtype, draft_dtype):
        if fmt not in (None, AUTO) and fmt not in OPENVINO_FORMATS:
            raise SpecDecodeError(
                f"the openvino backend runs {', '.join(OPENVINO_FORMATS)}, not {fmt!r} "
                "(for w8a8 use int8: OpenVINO quantizes the activations itself)"
            )


def _unmeasured_default(backend: str, device: str, target: str) -> str:
    """The target's format under dtype='auto' where nothing is measured: OpenVINO's 4-bit groups
    (models/openvino.default_format: int4-g128 where the widths allow), bf16 on a GPU, fp32
    otherwise."""
    if backend == "openvino":
        import torch

        from .models import resolve
        from .models.openvino import default_format

        return default_format(resolve(target, torch.bfloat16))
    return "bf16" if device == "cuda" else "fp32"


def spec_fields(config: SpecConfig, keep_default_policy: bool = False) -> dict:
    """A parsed SpecConfig's fields as open_models() keywords (the method, the draft's format and
    invariance are open_models' own arguments). keep_default_policy: the user gave no --policy,
    so open_models picks it (default_policy)."""
    from dataclasses import fields

    skip = ("method", "draft_dtype", "batch_invariant", *(("policy",) if keep_default_policy else ()))
    return {f.name: getattr(config, f.name) for f in fields(config) if f.name not in skip}


def _head_fallback(config: SpecConfig) -> str:
    """How a draft_vocab head falls back, in words (the choice line)."""
    window = FALLBACK if config.draft_vocab_fallback is None else config.draft_vocab_fallback
    if not window:
        return "always; --draft-vocab full for the whole head"
    return f"the whole head where a quarter of a row's last {window} tokens are outside it"


def default_draft_vocab(draft: str | None, method: str | None, backend: str, device: str) -> str | None:
    """The draft head's list when none is given: a zoo draft model's shipped list (the
    Qwen2.5-Coder 0.5B: 32,768 ids, with the per-row fallback to the whole head; measured on the
    pair, benchmarks/NOTES.md issue 53) where our lean runtime runs it on the CPU; else the whole
    head."""
    from .models import ZOO

    entry = ZOO.get(str(draft)) if draft is not None else None
    if entry is None or method not in ("draft", "auto") or backend not in ("auto", "lean") or device != "cpu":
        return None
    return entry.draft_vocab


def default_policy(method: str | None, has_draft_model: bool, tree: bool = False) -> str:
    """The draft-length policy when none is given: fixed for a token tree (its shape is fixed);
    prefix for a draft model (draft, auto: stop drafting once the product of the draft's
    probabilities of its tokens this round falls below a threshold set by the measured costs;
    measured on the Qwen pair, faster than the confidence policy's per-token 0.4 at k = 4, which
    was 3-13% faster than fixed k: benchmarks/NOTES.md, issues 35 and 53), fixed k otherwise."""
    return "prefix" if has_draft_model and method in ("draft", "auto") and not tree else "fixed"


def _with_prefix_threshold(config: SpecConfig, choice: Choice) -> tuple[SpecConfig, str]:
    """The prefix policy's threshold from the measured costs when none was given (else the
    default), and the words for the choice line."""
    if config.policy != "prefix":
        return config, ""
    if config.confidence_threshold is not None:
        return config, f"; draft policy prefix (stops below {config.confidence_threshold:g}, as asked)"
    measured = choice.prefix_threshold()
    if measured is None:
        return config, ""
    words = f"; draft policy prefix (stops below {measured:g}: a draft step and a verified row over a step)"
    return replace(config, confidence_threshold=measured), words


@dataclass
class Loaded:
    """What open_models() returns: the models, their formats and the options they run with."""

    target: Any
    draft: Any
    choice: Choice
    config: SpecConfig


def default_method(target: str, draft: str | None, method: str | None) -> str | None:
    """The drafting method a front end (serve, chat) runs when none is asked: draft with a draft
    model; auto for a known model without one (suffix matches, and the bundled EAGLE-3 drafter
    where there is one); else none. "none" asks for no speculation."""
    from .models import ZOO

    if method == "none":
        return None
    if method is not None:
        return method
    if draft:
        return "draft"
    return "auto" if str(target) in ZOO else None


def default_k(target: str) -> int:
    """k when none is asked: 2 for smollm2-135m (its measured best), else 4."""
    return 2 if str(target) == "smollm2-135m" else 4


def open_models(
    target: str,
    *,
    draft: str | None = None,
    method: str | None = None,
    k: int | None = None,
    dtype: str | None = None,
    draft_dtype: str | None = None,
    backend: str = "auto",
    device: str = "cpu",
    batch_invariant: bool | None = None,
    recalibrate: bool = False,
    log=None,
    progress=None,
    **options: Any,
) -> Loaded:
    """Load the target (and draft model) in their formats and build the SpecConfig; see `open`.
    For front ends that make several generators over the same models (the demo, benchmarks)."""
    import torch

    from .models import load, resolve, resolve_device

    log = log if log is not None else (lambda line: print(line, file=sys.stderr))
    target = str(target)
    method = method or ("draft" if draft else None)
    if method == "draft" and not draft:
        raise SpecDecodeError("method 'draft' needs a draft model (--draft MODEL)")
    asked = dtype
    dtype = check_format(dtype or default_dtype(target), "dtype")
    check_draft_dtype(draft_dtype, draft, method)
    if backend not in BACKENDS:
        raise SpecDecodeError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    dev = resolve_device(device)

    k = k if k is not None else SpecConfig.k
    if options.get("policy") is None:
        options["policy"] = default_policy(method, draft is not None, options.get("tree") is not None)
    if options.get("draft_vocab") is None:
        options["draft_vocab"] = default_draft_vocab(draft, method, backend, resolve_device(device).type)
    # validate the options before anything loads (SpecConfig's one-line errors)
    base = SpecConfig(method=method, k=k, **options)
    if backend == "openvino":
        _check_openvino(dtype, draft_dtype, batch_invariant, base)
    speculative = method is not None
    has_draft_model = draft is not None
    draft_auto = has_draft_model and draft_dtype in (None, AUTO) and (dtype == AUTO or draft_dtype == AUTO)

    shapes = _lean_shapes(target, backend) if dev.type == "cpu" else None
    invariant = bool(shapes is not None) if batch_invariant is None else bool(batch_invariant)
    draft_shapes = _lean_shapes(draft, backend) if has_draft_model and shapes is not None else None
    if draft_shapes is not None and base.draft_vocab not in (None, FULL):  # the head it will really run
        draft_shapes = replace(draft_shapes, vocab=vocab_size(base.draft_vocab, draft_shapes.vocab))
    if (dtype == AUTO or (draft_auto and draft_shapes is not None)) and shapes is not None:
        choice = choose(
            shapes,
            draft_shapes if draft_auto else None,
            k=base.k,
            invariant=invariant,
            speculative=speculative,
            name=Path(target).name,
            target_formats=TARGET_CANDIDATES if dtype == AUTO else (_kernel_of(dtype),),
            recalibrate=recalibrate,
            progress=progress,
        )
        if dtype != AUTO:
            choice.target = dtype
        if has_draft_model and not (draft_auto and draft_shapes is not None):
            choice.draft = _pinned_draft(draft_dtype, choice.target, draft_shapes is not None)
    else:  # nothing to measure: a pinned format, another backend or device
        t = dtype if dtype != AUTO else _unmeasured_default(backend, dev.type, target)
        d = _pinned_draft(draft_dtype, t, draft_shapes is not None, backend) if has_draft_model else None
        choice = Choice(t, d, base.k, invariant, "pinned" if asked not in (None, AUTO) else "default")
    base, policy_words = _with_prefix_threshold(base, choice)
    if dtype == AUTO or draft_auto or backend == "openvino":
        line = choice.line() + ("; OpenVINO's CPU plugin" if backend == "openvino" else "")
        if has_draft_model and base.draft_vocab not in (None, FULL):
            line += f"; the draft's head over {base.draft_vocab!s} ({_head_fallback(base)})"
        log(line + policy_words)

    t_dtype, t_quant = weight_format(choice.target)
    resolve(target, t_dtype if t_quant is None else torch.bfloat16)
    target_model = load(target, backend=backend, dtype=t_dtype, device=dev, quant=t_quant)
    draft_model = None
    if has_draft_model:
        d_dtype, d_quant = weight_format(choice.draft)
        draft_model = load(draft, backend=backend, dtype=d_dtype, device=dev, quant=d_quant)
        if choice.draft_prefill is not None and draft_model.lean:
            # the draft's prompts on a second copy in the format that runs prompts fastest
            # (autotune.py): drafts only, so the output is the same whatever their weights
            p_dtype, p_quant = weight_format(choice.draft_prefill)
            draft_model.prefill_model = load(draft, backend=backend, dtype=p_dtype, device=dev, quant=p_quant)
    if backend == "openvino":
        # OpenVINO's plugin has the cores now; torch's OpenMP workers spin for milliseconds after
        # each op of the round (sampling, verification) and took ~30% of its step (docs/openvino.md)
        torch.set_num_threads(1)
    heads = method_heads(target, method, options.pop("heads", None), draft=draft)
    head_dtype = draft_dtype if (draft_dtype not in (None, AUTO) and not has_draft_model) else None
    config = replace(
        base,
        heads=heads,
        batch_invariant=(invariant and target_model.lean) or None,
        draft_dtype=head_dtype,
    )
    return Loaded(target_model, draft_model, choice, config)


def open(target: str, *, draft: str | None = None, method: str | None = None, **kwargs: Any):  # noqa: A001
    """A SpeculativeGenerator from names and options, the way every front end makes one.

    target / draft: a known name (qwen2.5-coder-1.5b, smollm2-135m, ...), a bundled name or a
    Hugging Face model directory. method: a drafter (default 'draft' with a draft model, else
    target-only); 'none' (as on the command line) or None without a draft model: target-only.
    dtype / draft_dtype: a weight format (formats.py) or 'auto', measured on this
    machine and cached (the default for known models; fp32 otherwise). batch_invariant: default
    on for our lean runtime on CPU (greedy speculative output equals target-only), False opts out.
    k and every other SpecConfig field (policy, tree, heads, draft_vocab, ...) as keywords;
    backend, device; recalibrate=True measures again; log(line) receives the choice line
    (default: stderr). The generator's `choice` says which formats run and why."""
    from .engine import SpeculativeGenerator

    if method == "none":
        if draft:
            raise SpecDecodeError("method 'none' runs the target alone; drop the draft model or the method")
        method = None
    loaded = open_models(target, draft=draft, method=method, **kwargs)
    gen = SpeculativeGenerator(loaded.target, draft=loaded.draft, config=loaded.config)
    gen.choice = loaded.choice
    return gen


def method_heads(target: str, method: str | None, heads: str | None, draft: str | None = None) -> Path | None:
    """The trained drafter a method reads: required for medusa, eagle and eagle3; for auto the
    bundled (or given) EAGLE-3 drafter when there is one and no draft model is given."""
    if method in ("medusa", "eagle", "eagle3"):
        return heads_dir(target, method, heads)
    if method == "auto" and draft and not heads:
        return None  # auto's model drafter is the draft model
    if method == "auto":
        try:
            return heads_dir(target, "eagle3", heads)
        except SpecDecodeError:
            return None
    if heads:
        raise SpecDecodeError(f"--heads is read by methods medusa, eagle, eagle3 and auto, not {method!r}")
    return None


def heads_dir(target: str, method: str, heads: str | None) -> Path:
    """--heads, or the drafter bundled for the target (models/<family>/<method>, or
    models/<name>/<method> for a known name such as smollm2-135m)."""
    from .models import ZOO, models_dir, resolve

    if heads:
        return Path(heads)
    bundled = (models_dir() / target if target in ZOO else resolve(target).parent) / method
    if not (bundled / "config.json").exists():
        what = {"medusa": "Medusa heads", "eagle3": "EAGLE-3 drafter"}.get(method, "EAGLE drafter")
        raise SpecDecodeError(f"no {what} for {target}; pass --heads DIR (see train-heads)")
    return bundled
