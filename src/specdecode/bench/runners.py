"""What the benchmark times: one object per configuration, each generating exactly
max_new_tokens tokens for a tokenized prompt and reporting what it did.

transformers runs the same checkpoints through `AutoModelForCausalLM.generate` (plain,
assisted with our draft, prompt lookup); ours runs SpeculativeGenerator. EOS never stops a
run (transformers: eos_token_id=None; ours: ignore_eos), so every run makes the same number
of tokens and tokens/s compare like for like.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.sampling import SamplingParams
from ..engine import SpeculativeGenerator


@dataclass
class Run:
    tokens: int
    seconds: float
    forwards: int  # target forwards that produced tokens (prefill excluded where separate)
    rounds: int = 0
    drafted: int = 0
    tested: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)  # what was generated (greedy identity checks)


@dataclass
class Runner:
    name: str  # e.g. "ours draft (fixed)"
    engine: str  # "transformers" or "ours"
    method: str  # target-only, draft, ngram, ... (transformers: generate, assisted, lookup)
    policy: str = "-"
    settings: dict = field(default_factory=dict)

    def run(self, ids: list[int], temperature: float, max_new: int, seed: int) -> Run:
        raise NotImplementedError

    def forget(self) -> None:
        """Forget earlier runs' answers (ours: the suffix cache; the others keep none)."""


class OursRunner(Runner):
    def __init__(
        self,
        name: str,
        gen: SpeculativeGenerator,
        method: str,
        policy: str,
        settings: dict,
        sampling_rule: str = "standard",
    ) -> None:
        super().__init__(name, "ours", method, policy, settings)
        self.gen, self.sampling_rule = gen, sampling_rule

    def params(self, temperature: float, max_new: int, seed: int) -> SamplingParams:
        return SamplingParams(
            temperature=temperature,
            max_new_tokens=max_new,
            seed=seed,
            ignore_eos=True,
            sampling_rule=self.sampling_rule,
        )

    def forget(self) -> None:
        self.gen.forget()

    def run(self, ids: list[int], temperature: float, max_new: int, seed: int) -> Run:
        params = self.params(temperature, max_new, seed)
        t0 = time.perf_counter()
        (res,) = self.gen.generate([ids], params)
        seconds = time.perf_counter() - t0
        st = res.stats
        return Run(
            len(res.token_ids),
            seconds,
            st.target_forwards,
            st.rounds,
            st.drafted,
            st.tested,
            st.accepted,
            st.draft_s,
            st.target_s,
            list(res.token_ids),
        )


class TransformersRunner(Runner):
    """transformers' generate on the target; `assistant` for assisted generation, lookup for
    prompt lookup. Target forwards are counted with a forward hook."""

    def __init__(self, name: str, model, method: str, settings: dict, assistant=None, assistant_config=None):
        super().__init__(name, "transformers", method, "-", settings)
        self.model = model
        self.assistant = assistant
        self.assistant_config = assistant_config or {}
        self.calls = 0
        model.register_forward_hook(self._count)

    def _count(self, *_args) -> None:
        self.calls += 1

    def run(self, ids: list[int], temperature: float, max_new: int, seed: int) -> Run:
        kw: dict = dict(max_new_tokens=max_new, eos_token_id=None, pad_token_id=0)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False)
        if self.method == "assisted":
            kw["assistant_model"] = self.assistant
            for key, value in self.assistant_config.items():  # read by transformers from here
                setattr(self.assistant.generation_config, key, value)
        elif self.method == "lookup":
            kw["prompt_lookup_num_tokens"] = self.settings["k"]
        torch.manual_seed(seed)
        self.calls = 0
        inputs = torch.tensor([ids], device=self.model.device)
        t0 = time.perf_counter()
        out = self.model.generate(inputs, **kw)
        seconds = time.perf_counter() - t0
        n = out.shape[1] - inputs.shape[1]
        return Run(n, seconds, self.calls, token_ids=out[0, inputs.shape[1] :].tolist())


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work before reading a clock (nothing to wait for on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def load_transformers(path: Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A checkpoint through transformers, in `dtype`, eval mode, on `device`, no network."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model.to(device).eval()


class LlamaCppRunner(Runner):
    """llama.cpp (llama-cpp-python) on a GGUF file: an optional peer, used only when
    `llama_cpp` is importable. Greedy only; it runs the GGUF's own quantization."""

    def __init__(self, gguf: Path, threads: int, context: int) -> None:
        import llama_cpp

        super().__init__(f"llama.cpp ({gguf.name})", "llama.cpp", "generate", "-", {"threads": threads})
        self.llm = llama_cpp.Llama(
            model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False
        )

    def run(self, ids: list[int], temperature: float, max_new: int, seed: int) -> Run:
        self.llm.reset()
        out: list[int] = []
        t0 = time.perf_counter()
        for tok in self.llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(int(tok))
            if len(out) >= max_new:
                break
        seconds = time.perf_counter() - t0
        return Run(len(out), seconds, len(out), token_ids=out)
