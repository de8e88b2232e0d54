"""The real pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B-Instruct draft), installed by `make
models`: slow (minutes), so marked `real` and run by `make test-real`, never by `make test`.

- both GGUFs assemble from their chunks with the pinned sha256;
- greedy output of our runtime equals transformers' `generate` in fp32 on six prompts, for
  both models;
- with the forward batch-invariant, every method's greedy tokens equal target-only's, with the
  draft in another dtype than the target (its precision never changes the output);
- under the invariant sampling rule a seeded T = 1 sample is seeded target-only's text, with a
  w8a8 target and draft (the fastest pair here) and a token tree.
"""

import hashlib

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator, load
from specdecode.models import ZOO

pytestmark = pytest.mark.real

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
PROMPTS = (
    "def fibonacci(n):\n",
    "Write a Python function that checks whether a number is prime.",
    "Explain what a Python decorator is in one sentence.",
    "Rename `lst` to `numbers`:\n```python\ndef total(lst):\n    return sum(lst)\n```",
    "What is 17 * 23?",
    "import numpy as np\n\n# normalise each row of a matrix\ndef normalise(m):\n",
)


def _installed():
    if not all(ZOO[n].installed() for n in (TARGET, DRAFT)):
        pytest.skip("the Qwen2.5-Coder pair is not installed; run `make models`")


@pytest.mark.parametrize("name", [TARGET, DRAFT])
def test_the_assembled_gguf_has_the_pinned_sha256(name):
    _installed()
    model = ZOO[name]
    path = model.gguf_path()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    assert path.stat().st_size == model.size and digest.hexdigest() == model.sha256


def _ids(model, text: str) -> list[int]:
    if text.startswith(("def ", "import ")):
        return model.tokenizer.encode(text)  # raw completion
    return model.tokenizer.encode_chat([{"role": "user", "content": text}])


@pytest.mark.parametrize("name", [TARGET, DRAFT])
def test_greedy_equals_transformers_generate_in_fp32(name):
    from transformers import AutoModelForCausalLM

    from specdecode.models import resolve

    _installed()
    ours = load(name, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(resolve(name)), dtype=torch.float32).eval()
    gen = SpeculativeGenerator(ours)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    for text in PROMPTS:
        ids = _ids(ours, text)
        (res,) = gen.generate([ids], params)
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(ids) :].tolist()
        assert res.token_ids == ref, text


def test_every_method_keeps_target_only_tokens_batch_invariant():
    _installed()
    target = load(TARGET, dtype=torch.float32)
    draft = load(DRAFT, dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_new_tokens=40)
    prompts = [_ids(target, t) for t in PROMPTS[:2]]
    want = [r.token_ids for r in SpeculativeGenerator(target, batch_invariant=True).generate(prompts, params)]
    for kw in (
        {"method": "draft", "k": 4, "draft": draft},
        {"method": "draft", "tree": "3,2,1", "draft": draft},
        {"method": "auto", "k": 4, "draft": draft},
        {"method": "suffix", "k": 4},
        {"method": "ngram", "k": 3},
    ):
        gen = SpeculativeGenerator(target, batch_invariant=True, **kw)
        got = [r for p in prompts for r in gen.generate([p], params)]
        assert [r.token_ids for r in got] == want, kw
        if kw["method"] == "draft":
            assert sum(r.stats.accepted for r in got) > 0


def test_invariant_rule_seeded_samples_equal_target_only_on_the_pair():
    _installed()
    target = load(TARGET, dtype=torch.float32, quant="w8a8")
    draft = load(DRAFT, dtype=torch.float32, quant="w8a8")
    prompts = [_ids(target, t) for t in PROMPTS[:3]]
    params = [
        SamplingParams(temperature=1.0, seed=11 + i, max_new_tokens=40, sampling_rule="invariant")
        for i in range(len(prompts))
    ]
    want = [r.token_ids for r in SpeculativeGenerator(target, batch_invariant=True).generate(prompts, params)]
    for kw in ({"k": 4}, {"tree": "3,2,1"}):
        gen = SpeculativeGenerator(target, draft=draft, batch_invariant=True, **kw)
        got = [gen.generate([p], prm)[0] for p, prm in zip(prompts, params)]
        assert [r.token_ids for r in got] == want, kw
        assert sum(r.stats.accepted for r in got) > 0
