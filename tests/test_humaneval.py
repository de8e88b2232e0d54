"""HumanEval as a bench prompt set: the tasks load, and pass@1 runs each completion with its
task's own tests (a right answer passes, a wrong one, a crash and a hang fail)."""

import pytest

from specdecode.bench.humaneval import pass_at_1, program, raw_completion
from specdecode.bench.model_bench import read_prompts


def test_humaneval_prompts_load_with_their_tasks():
    prompts = read_prompts("humaneval")
    assert len(prompts) == 82 and {p["category"] for p in prompts} == {"humaneval"}
    first = prompts[0]
    assert first["id"] == "HumanEval/0" and first["task"]["entry_point"] == "has_close_elements"
    assert first["chat_text"].endswith("```") and first["text"] in first["chat_text"]


@pytest.mark.heavy
def test_pass_at_1_passes_a_right_completion_and_fails_wrong_crashing_and_hanging_ones():
    task = read_prompts("humaneval")[1]["task"]  # truncate_number: the decimal part
    right = "    return number % 1.0\n\ndef unrelated():\n    raise SystemExit(1)\n"
    assert raw_completion(right) == "    return number % 1.0\n"  # cut where the function ends
    res = pass_at_1(
        [task] * 4,
        [right, "    return 0.0\n", "    return undefined_name\n", "    while True:\n        pass\n"],
        chat=False,
        timeout=3,
    )
    assert res == {"passed": 1, "tasks": 4, "pass_at_1": 0.25}


def test_a_chat_answer_is_scored_from_its_code_block():
    task = read_prompts("humaneval")[1]["task"]
    answer = (
        "Here it is:\n```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0\n```\n"
    )
    assert "check(truncate_number)" in program(task, answer, chat=True)
    assert pass_at_1([task], [answer], chat=True)["passed"] == 1
    assert pass_at_1([task], ["I cannot help with that."], chat=True)["passed"] == 0
