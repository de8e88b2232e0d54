"""The training prompt set (data/distill-prompts.jsonl) is disjoint from the evaluation prompts
(Spec-Bench): a drafter measured on Spec-Bench never trained on its questions."""

import json
from pathlib import Path

from specdecode.bench.model_bench import SPEC_BENCH
from specdecode.train.distill import read_prompts

ROOT = Path(__file__).resolve().parents[1]


def normal(text: str) -> str:
    return " ".join(text.lower().split())


def test_no_evaluation_prompt_appears_in_the_training_prompts():
    train = [normal(p) for p in read_prompts(ROOT / "data" / "distill-prompts.jsonl")]
    assert len(train) > 2000 and len(set(train)) == len(train)
    evaluation = set()
    for line in SPEC_BENCH.read_text(encoding="utf-8").splitlines():
        evaluation.update(normal(t) for t in json.loads(line)["turns"])
    assert len(evaluation) > 250  # 180 questions; the 80 MT-bench ones have two turns
    assert not evaluation & set(train)
    # nor is any evaluation prompt contained in a training prompt (e.g. quoted inside a template)
    joined = "\n".join(train)
    long_ones = [e for e in evaluation if len(e) > 40]
    assert not [e for e in long_ones if e in joined]
