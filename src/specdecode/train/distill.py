"""`specdecode distill-data`: the target's own answers to a prompt set (self-distillation), stored
with the target features a drafter trains on, so that training never runs the target again.

A data directory holds
    index.json   what was generated (target, dtype, chat, temperatures, aux layers) and where
                 each sequence lies: [start, prompt_length, length] per sequence
    tokens.bin   int32, every sequence's prompt + answer tokens back to back
    aux.bin      float16 [tokens, len(aux_layers) * hidden]: the residual stream entering each
                 aux layer (EAGLE-3's low, middle and high features)
    final.bin    float16 [tokens, hidden]: the final-normed hidden state (the target's logits
                 are lm_head(final), so training can match the target's whole distribution)
    answers.jsonl the prompts and answer texts, for reading
Read it back with DistillData(path): numpy memory maps, nothing loaded until it is touched.
Generation is batched (rows admitted as others finish) and resumable: a rerun with the same
--out continues after the last sequence written.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..drafters.base import Drafter
from ..errors import SpecDecodeError

KIND = "specdecode-distill"


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high feature layers (vLLM's default: 2, L // 2, L - 3)."""
    return (2, num_layers // 2, num_layers - 3) if num_layers >= 6 else (0, num_layers // 2, num_layers - 1)


def read_prompts(path: str | Path) -> list:
    """Prompts from a JSONL file: each line {"prompt": text}, {"messages": [...]}, {"turns":
    [text, ...]} (MT-bench style; the first turn is used), {"token_ids": [...]} or a bare JSON
    string."""
    path = Path(path)
    if not path.exists():
        raise SpecDecodeError(f"prompt file {path} not found")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecDecodeError(f"{path}:{n} is not JSON ({e.msg})") from None
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            out.append(item["prompt"])
        elif isinstance(item, dict) and isinstance(item.get("messages"), list):
            out.append(item["messages"])
        elif isinstance(item, dict) and isinstance(item.get("turns"), list) and item["turns"]:
            out.append(item["turns"][0])
        elif isinstance(item, dict) and isinstance(item.get("token_ids"), list) and item["token_ids"]:
            out.append([int(t) for t in item["token_ids"]])
        else:
            raise SpecDecodeError(
                f'{path}:{n}: needs {{"prompt": ...}}, {{"messages": ...}} or {{"turns": ...}}'
            )
    if not out:
        raise SpecDecodeError(f"{path} holds no prompts")
    return out


@dataclass
class DistillData:
    """A distill-data directory, memory-mapped."""

    path: Path
    index: dict
    tokens: np.ndarray  # [N] int32
    aux: np.ndarray  # [N, 3d] float16
    final: np.ndarray  # [N, d] float16

    @staticmethod
    def open(path: str | Path) -> DistillData:
        path = Path(path)
        f = path / "index.json"
        if not f.exists():
            raise SpecDecodeError(f"{path} holds no distilled data; make it with `specdecode distill-data`")
        index = json.loads(f.read_text())
        if index.get("kind") != KIND:
            raise SpecDecodeError(f"{f} is not a specdecode distill-data index")
        n, d, a = index["num_tokens"], index["hidden_size"], len(index["aux_layers"])
        if n == 0:
            raise SpecDecodeError(f"{path} holds no sequences yet")

        def mm(name, dtype, shape):
            return np.memmap(path / name, dtype=dtype, mode="r", shape=shape)

        return DistillData(
            path,
            index,
            mm("tokens.bin", np.int32, (n,)),
            mm("aux.bin", np.float16, (n, a * d)),
            mm("final.bin", np.float16, (n, d)),
        )

    @property
    def sequences(self) -> list[list[int]]:
        return self.index["sequences"]

    def answer_tokens(self) -> np.ndarray:
        """Every answer token (prompts excluded), for counting token frequencies."""
        parts = [self.tokens[s + p : s + n] for s, p, n in self.sequences]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def _parse_temperatures(text: str | float) -> list[float]:
    try:
        temps = [float(t) for t in str(text).split(",")]
    except ValueError:
        raise SpecDecodeError(f"--temperature takes numbers separated by commas, got {text!r}") from None
    if not temps or any(not t >= 0 for t in temps):
        raise SpecDecodeError(f"temperatures must be >= 0, got {text!r}")
    return temps


class _Recorder(Drafter):
    """A drafter that drafts nothing and keeps what the engine shows it: the target's features
    (`aux_layers`) of every committed token, computed by the decoding forwards themselves, so
    recording costs no extra forward. A finished row's features are set aside when it retires."""

    name = "record"
    requires_hidden = True

    def __init__(self, aux_layers: tuple[int, ...]) -> None:
        self.aux_layers = aux_layers

    def target_needs(self):
        from ..drafters import TargetNeeds

        return TargetNeeds(hidden=True, aux_layers=self.aux_layers)

    def start(self, ctx, target_cache) -> dict:
        return {"feats": [[] for _ in range(ctx.size)], "retired": []}

    def propose(self, state, ctx, limits, stop_below=None):
        from ..core.proposal import Proposal

        return Proposal.empty(ctx.size, ctx.device)

    def observe(self, state, hidden, start, count) -> None:
        for b, n in enumerate(count.tolist()):
            state["feats"][b].append(hidden[b, :n].clone())

    def commit(self, state, lengths) -> None:
        pass

    def select_rows(self, state, rows) -> None:
        keep = set(rows.tolist())
        state["retired"] += [f for b, f in enumerate(state["feats"]) if b not in keep]
        state["feats"] = [state["feats"][b] for b in rows.tolist()]

    def add_rows(self, state, new) -> None:
        state["feats"] += new["feats"]


def distill(
    target: str | Path,
    prompts_file: str | Path,
    out: str | Path,
    *,
    chat: bool = True,
    max_new_tokens: int = 256,
    temperature: str | float = "0",
    batch_size: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    limit: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Answer every prompt with the target (prompt i at temperature temps[i % len(temps)]) and
    store tokens and features under `out`. Returns the index."""
    from ..core.config import SpecConfig
    from ..core.sampling import SamplingParams
    from ..engine import Generation
    from ..engine.policy import FixedPolicy
    from ..engine.speculation import build, encode
    from ..models import load
    from ..models.llama import _rms_norm

    if max_new_tokens < 1 or batch_size < 1:
        raise SpecDecodeError("--max-new-tokens and --batch-size must be >= 1")
    temps = _parse_temperatures(temperature)
    prompts = read_prompts(prompts_file)
    if limit is not None:
        prompts = prompts[:limit]
    model = load(target, dtype=dtype)
    if not model.lean:
        raise SpecDecodeError("distill-data needs a Llama target on our lean runtime")
    if chat and (model.tokenizer is None or not model.tokenizer.chat_template):
        raise SpecDecodeError(f"{target} has no chat template; drop --chat")
    cfg = model.cfg
    aux_layers = (*eagle3_layers(cfg.num_layers), cfg.num_layers)  # + the last layer's output
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    index_file = out / "index.json"
    fresh = {
        "kind": KIND,
        "target": str(target),
        "dtype": str(dtype).removeprefix("torch."),
        "chat": chat,
        "temperatures": temps,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "prompts_file": str(prompts_file),
        "aux_layers": list(aux_layers[:3]),
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "done": [],
        "num_tokens": 0,
        "generate_seconds": 0.0,
        "sequences": [],
    }
    index = fresh
    if index_file.exists():
        index = json.loads(index_file.read_text())
        keys = ("target", "chat", "temperatures", "max_new_tokens", "aux_layers")
        same, want = {k: index.get(k) for k in keys}, {k: fresh[k] for k in keys}
        if same != want:
            raise SpecDecodeError(f"{out} holds data made with other settings ({same}); pick a new --out")
    d, a = cfg.hidden_size, 3
    sizes = {"tokens.bin": 4, "aux.bin": 2 * a * d, "final.bin": 2 * d}
    files = {name: open(out / name, "ab") for name in sizes}
    for name, fh in files.items():  # a rerun continues after the last sequence the index records
        fh.truncate(index["num_tokens"] * sizes[name])
        fh.seek(0, 2)
    answers = open(out / "answers.jsonl", "a", encoding="utf-8")
    recorder = _Recorder(aux_layers)
    # target-only decoding (the recorder drafts nothing) that records features
    spec = build(model, None, SpecConfig())
    spec = replace(spec, drafter=recorder, needs=recorder.target_needs())
    d_eps = cfg.hidden_size * cfg.rms_norm_eps

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=temps[i % len(temps)], seed=seed + i, max_new_tokens=max_new_tokens)

    def prompt_of(i: int):
        p = prompts[i]
        return [{"role": "user", "content": p}] if chat and isinstance(p, str) else p

    def store(i: int, tokens: list[int], prompt_len: int, answer: list[int], feats: list) -> None:
        h = torch.cat(feats)  # every token but the last was fed to the target: zeros for it
        n = len(tokens)
        h = torch.cat([h, h.new_zeros(n - h.shape[0], h.shape[1])])
        last = _rms_norm(h[:, a * d :], model._final_norm_s, d_eps)
        files["tokens.bin"].write(np.asarray(tokens, np.int32).tobytes())
        files["aux.bin"].write(h[:, : a * d].to(torch.float16).numpy().tobytes())
        files["final.bin"].write(last.to(torch.float16).numpy().tobytes())
        index["sequences"].append([index["num_tokens"], prompt_len, n])
        index["num_tokens"] += n
        text = model.tokenizer.decode(answer) if model.tokenizer is not None else ""
        answers.write(json.dumps({"id": i, "prompt": prompts[i], "answer": text}, ensure_ascii=False) + "\n")

    def save() -> None:
        for fh in files.values():
            fh.flush()
        answers.flush()
        tmp = index_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(index))
        tmp.replace(index_file)

    finished_ids = set(index["done"])
    todo = [i for i in range(len(prompts)) if i not in finished_ids]
    refill = max(1, batch_size // 4)  # admit new rows in groups: one prefill and one cache copy each
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("distill"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"))
    t0 = time.perf_counter()
    with Progress(*columns, TimeElapsedColumn(), disable=not progress) as bar:
        task = bar.add_task("distill", total=len(prompts), completed=len(finished_ids), info="")
        if todo:
            first, nxt = todo[:batch_size], min(batch_size, len(todo))
            ids = [encode(model, prompt_of(i)) for i in first]
            run = Generation(spec, ids, [params(i) for i in first], policy=FixedPolicy(0))
            prompt_of_row = dict(enumerate(first))
            for event in run:
                retired = run.state["retired"]
                run.state["retired"] = []
                ended = [rid for rid, f in zip(event.rows, event.finished) if f]
                for rid, feats in zip(ended, retired):
                    i, out_row = prompt_of_row[rid], run.outputs[rid]
                    answer = list(out_row.tokens)
                    tokens = encode(model, prompt_of(i)) + answer
                    store(i, tokens, len(tokens) - len(answer), answer, feats)
                    index["done"].append(i)
                if ended:
                    index["generate_seconds"] += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    save()
                    bar.update(task, advance=len(ended), info=f"{index['num_tokens']:,} tokens")
                free = batch_size - run.rows.size
                if nxt < len(todo) and (free >= refill or run.rows.size == 0):
                    new = todo[nxt : nxt + free]
                    nxt += len(new)
                    rids = run.add_many([prompt_of(i) for i in new], [params(i) for i in new])
                    prompt_of_row.update(zip(rids, new))
        index["generate_seconds"] += time.perf_counter() - t0
        save()
    for fh in files.values():
        fh.close()
    answers.close()
    return index
