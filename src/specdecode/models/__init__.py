"""Loading models by bundled name or path; our lean runtime when it can, transformers otherwise."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from ..errors import SpecDecodeError
from ..formats import BACKENDS, GGUF_FORMATS
from .base import PLAIN, WITH_HIDDEN, CausalLM, ForwardMeta, extend, logits_of
from .hf import HFModel
from .llama import LlamaConfig, LlamaModel, return_freed_memory
from .quant import KERNEL_KINDS, QUANT_KINDS
from .tokenizer import TextTokenizer
from .zoo import ZOO, ChunkedZooModel, ZooModel, cache_dir

GGUF_QUANTS = GGUF_FORMATS

BUNDLED = (
    "three-kingdoms/target",
    "three-kingdoms/draft-64",
    "three-kingdoms/draft-128",
    "three-kingdoms/hybrid",  # 3 of 4 layers linear attention (train/hybrid.py)
    "python-code/target",
    "python-code/draft",
)


__all__ = [
    "BUNDLED",
    "ZOO",
    "ChunkedZooModel",
    "ZooModel",
    "PLAIN",
    "WITH_HIDDEN",
    "CausalLM",
    "ForwardMeta",
    "HFModel",
    "LlamaModel",
    "extend",
    "gguf_source",
    "load",
    "logits_of",
    "models_dir",
    "resolve",
    "resolve_device",
    "cache_dir",
]


def models_dir() -> Path:
    """Where bundled checkpoints live: $SPECDECODE_MODELS, else the repository's models/."""
    env = os.environ.get("SPECDECODE_MODELS")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "models"


_DTYPE_DIRS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _zoo_dir(name: str, dtype: torch.dtype) -> Path:
    """The converted directory of a zoo model in `dtype`, converting the installed GGUF once."""
    if dtype not in _DTYPE_DIRS:
        raise SpecDecodeError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
    out = cache_dir() / name / _DTYPE_DIRS[dtype]
    if (out / "config.json").exists():
        return out
    try:
        gguf = ZOO[name].gguf_path()
    except SpecDecodeError as e:
        raise SpecDecodeError(f"model {name!r}: {e}") from None
    return _convert(gguf, out, dtype)


def _convert(gguf: Path, out: Path, dtype: torch.dtype) -> Path:
    """Convert a GGUF into the model directory `out` (once: the caller checked it is not there)."""
    from .gguf_import import import_gguf

    print(f"specdecode: converting {gguf.name} to {out} ({_DTYPE_DIRS[dtype]}, once)", file=sys.stderr)
    try:
        return import_gguf(gguf, out, dtype, progress=True)
    except OSError as e:
        raise SpecDecodeError(
            f"cannot write {out}: {e.strerror}; set SPECDECODE_CACHE to a writable directory"
        ) from None


def _file_hash(path: Path) -> str:
    """The sha256 of a file (its first 16 hex digits), read once per size and modification time
    (kept beside the conversions) so a 1 GB model is not hashed at every load."""
    import hashlib

    st = path.stat()
    index = cache_dir() / "gguf-files" / "hashes.json"
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    try:
        known = json.loads(index.read_text())
    except (OSError, json.JSONDecodeError):
        known = {}
    if key not in known:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
        known[key] = h.hexdigest()[:16]
        try:
            index.parent.mkdir(parents=True, exist_ok=True)
            index.write_text(json.dumps(known, indent=1))
        except OSError:
            pass
    return known[key]


def gguf_source(name_or_path: str | os.PathLike) -> Path | None:
    """The GGUF file a model comes from: a zoo name's installed file or a path ending in .gguf
    (None for anything else)."""
    s = str(name_or_path)
    if s in ZOO and not Path(s).is_dir():
        try:
            return ZOO[s].gguf_path()
        except SpecDecodeError as e:
            raise SpecDecodeError(f"model {s!r}: {e}") from None
    path = Path(s).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise SpecDecodeError(f"{s}: no such GGUF file; pass the path of a .gguf model file")
        return path
    return None


def _gguf_file_dir(path: Path, dtype: torch.dtype) -> Path:
    """The converted directory of any Llama/Qwen2/Qwen3 .gguf file (tokenizer, config, float
    weights for the embedding table), converted once and kept under the file's hash."""
    if dtype not in _DTYPE_DIRS:
        raise SpecDecodeError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
    out = cache_dir() / "gguf-files" / f"{path.stem}-{_file_hash(path)}" / _DTYPE_DIRS[dtype]
    return out if (out / "config.json").exists() else _convert(path, out, dtype)


def resolve(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Path:
    """A model directory for a bundled or zoo name or a path; SpecDecodeError if there is none.
    A zoo name (smollm2-135m, qwen2.5-coder-1.5b, ...) is converted from its installed GGUF on
    first use, in `dtype`; so is a path to a .gguf file (cached by the file's hash)."""
    s = str(name_or_path)
    if s in ZOO and not Path(s).is_dir():
        return _zoo_dir(s, dtype)
    path = Path(s).expanduser()
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        return _gguf_file_dir(gguf_source(path), dtype)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise SpecDecodeError(f"{s} has no config.json; pass a Hugging Face model directory")
        return path
    if s in BUNDLED:
        bundled = models_dir() / s
        if (bundled / "config.json").exists():
            return bundled
        raise SpecDecodeError(
            f"bundled model {s!r} is not trained yet (no {bundled}); train it with `specdecode train`"
        )
    raise SpecDecodeError(
        f"unknown model {s!r}: not a directory; use a Hugging Face model directory "
        f"or a known name ({', '.join((*ZOO, *BUNDLED))})"
    )


def _eos_ids(path: Path, cfg: dict) -> tuple[int, ...]:
    eos = None
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A torch device from 'cpu', 'cuda' or 'cuda:N'; SpecDecodeError if this machine has none."""
    try:
        dev = torch.device(device or "cpu")
    except RuntimeError:
        raise SpecDecodeError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SpecDecodeError(f"device {device!r}: this torch build or machine has no CUDA GPU; use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SpecDecodeError(
                f"device {device!r}: only {torch.cuda.device_count()} GPU(s) here; use cuda:0 .. "
                f"cuda:{torch.cuda.device_count() - 1}"
            )
    elif dev.type != "cpu":
        raise SpecDecodeError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    return dev


def _load_openvino(name_or_path, dtype: torch.dtype, device: torch.device, quant: str | None):
    """A model compiled by OpenVINO (models/openvino.py) in the format `dtype` / `quant` name;
    its graph is built once and kept under the model cache."""
    from ..formats import OPENVINO_FORMATS, format_name
    from .openvino import OVModel

    if device.type != "cpu":
        raise SpecDecodeError("the openvino backend runs on the CPU; drop --device or --backend openvino")
    fmt = format_name(dtype, quant)
    if fmt not in OPENVINO_FORMATS:
        raise SpecDecodeError(
            f"the openvino backend runs {', '.join(OPENVINO_FORMATS)}, not {fmt!r} "
            "(for w8a8 use int8: OpenVINO quantizes the activations itself)"
        )
    path = resolve(name_or_path, torch.float32 if fmt == "fp32" else torch.bfloat16)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise SpecDecodeError(f"{path}/config.json is not valid JSON ({e})") from None
    label = Path(str(name_or_path)).name
    model = OVModel.from_dir(path, fmt, cache=cache_dir() / "openvino", label=label)
    return _named(model, name_or_path, path, cfg)


def _gguf_qweights(name: str, fmt: str):
    """(the GGUF's quantized projections by our weight names, the kind the rest are quantized to)."""
    from .gguf_quant import read_qweights

    gguf = gguf_source(name)
    if gguf is None:
        raise SpecDecodeError(
            f"--dtype {fmt} keeps a GGUF's own quantization: use a zoo model "
            f"({', '.join(ZOO)}) or a .gguf file, or int4 / int8 to quantize {name}"
        )
    return read_qweights(gguf, fmt)


def load(
    name_or_path: str | os.PathLike,
    *,
    backend: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quant: str | None = None,
):
    """Load a model: our lean runtime for Llama, Qwen2 and Qwen3 checkpoints ('lean'),
    transformers otherwise ('hf'), or OpenVINO's CPU plugin ('openvino', models/openvino.py),
    its weights on `device` (cpu, cuda, cuda:N). Reads local files only; nothing is downloaded.
    quant: int8, int4 or int4-g128 quantizes every projection and the LM head at load
    (weight-only, models/quant.py; `dtype` is then the activations' type, bf16 is fastest);
    q4_k or q8_0 keeps the installed GGUF's own quantized blocks (zoo models, models/gguf_quant.py)."""
    dev = resolve_device(device)
    if backend == "openvino":
        return _load_openvino(name_or_path, dtype, dev, quant)
    qweights = None
    if quant is not None:
        known = (*QUANT_KINDS, *GGUF_QUANTS)
        if quant not in known:
            raise SpecDecodeError(f"unknown weight format {quant!r}; choose one of {', '.join(known)}")
        if backend == "hf":
            raise SpecDecodeError(f"{quant} weights run on our lean runtime only; drop backend='hf'")
        backend = "lean"
    path = resolve(name_or_path, dtype if quant is None else torch.bfloat16)
    fmt = quant
    if quant in GGUF_QUANTS or (quant in KERNEL_KINDS and gguf_source(name_or_path) is not None):
        qweights, quant = _gguf_qweights(str(name_or_path), quant)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise SpecDecodeError(f"{path}/config.json is not valid JSON ({e})") from None
    if backend not in BACKENDS:
        raise SpecDecodeError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    model: LlamaModel | HFModel
    use_lean = backend == "lean"
    if backend == "auto":
        try:
            LlamaConfig.from_dict(cfg)
            use_lean = True
        except (NotImplementedError, KeyError):
            use_lean = False
    if use_lean:
        try:
            model = LlamaModel.from_dir(path, dtype, dev, quant, qweights)
            if qweights is not None and hasattr(qweights, "release"):
                qweights.release()
        except KeyError as e:
            raise SpecDecodeError(f"{path}: weight {e} is missing; is this a Llama checkpoint?") from None
        except NotImplementedError as e:
            raise SpecDecodeError(
                f"{path}: our runtime cannot run this model ({e}); use backend='hf'"
            ) from None
    else:
        model = HFModel.from_dir(path, dtype, dev)
    if fmt is not None:
        model.quant = fmt
    return _named(model, name_or_path, path, cfg)


def _named(model, name_or_path, path: Path, cfg: dict):
    """The model with its name, path, tokenizer and end-of-sequence ids."""
    model.name = str(name_or_path)
    model.path = path
    model.tokenizer = TextTokenizer.from_dir(path)
    # the model's EOS, and the chat template's end-of-turn token (<|im_end|>, <|eot_id|>, ...)
    eos = _eos_ids(path, cfg)
    turn = model.tokenizer.end_of_turn_ids() if model.tokenizer is not None else ()
    model.eos_token_ids = tuple(dict.fromkeys((*eos, *turn)))
    return_freed_memory()
    return model
