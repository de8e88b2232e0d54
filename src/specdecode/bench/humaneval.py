"""HumanEval as a prompt set for `bench --prompts humaneval`, and pass@1 of greedy completions.

The 82 even-numbered tasks (benchmarks/prompts/humaneval, MIT). Raw completion: the model
continues the task's prompt (a signature and docstring); the completion is cut at the first
line that leaves the function (HumanEval's stop sequences). Chat: the model is asked to
complete the function and the first fenced code block of its answer is the program. Either
way the program runs with the task's own `check` in a separate Python process with a
timeout; pass@1 is the fraction of tasks whose check passes. Greedy speculation must leave
it unchanged: the tokens are the target's own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HUMANEVAL = (
    Path(__file__).resolve().parents[3] / "benchmarks" / "prompts" / "humaneval" / "humaneval-even.jsonl"
)
# a raw completion ends where the model leaves the function body (the Codex paper's stops)
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")
CHAT_INSTRUCTION = "Complete this Python function. Answer with the whole function in one code block.\n\n"


def chat_text(prompt: str) -> str:
    """The user message of a chat-mode task."""
    return f"{CHAT_INSTRUCTION}```python\n{prompt}```"


def raw_completion(text: str) -> str:
    """The completion up to the first stop sequence."""
    cut = min((i for s in STOP_SEQUENCES if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


_FENCE = re.compile(r"```(?:python|py)?\n(.*?)(?:```|$)", re.S)


def program(task: dict, completion: str, chat: bool) -> str:
    """The Python source that checks a completion: the code, the task's tests, the call."""
    if chat:
        m = _FENCE.search(completion)
        code = m.group(1) if m else completion
        # the prompt first (its imports and helpers; its function, a docstring alone, is valid
        # Python), then the answer's whole function, which replaces it, or else the body it gave
        glue = "\n" if f"def {task['entry_point']}" in code else ""
        code = task["prompt"] + glue + code
    else:
        code = task["prompt"] + raw_completion(completion)
    return f"{code}\n\n{task['test']}\n\ncheck({task['entry_point']})\n"


def passes(source: str, timeout: float = 10.0) -> bool:
    """Whether `source` runs to the end without an error in a fresh, isolated Python process."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-"],
                input=source,
                text=True,
                capture_output=True,
                timeout=timeout,
                cwd=tmp,
                env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"},
            )
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def pass_at_1(tasks: list[dict], completions: list[str], chat: bool, timeout: float = 10.0) -> dict:
    """{"passed", "tasks", "pass_at_1"} of greedy completions (one per task, in order)."""
    ok = [passes(program(t, c, chat), timeout) for t, c in zip(tasks, completions)]
    return {"passed": sum(ok), "tasks": len(ok), "pass_at_1": round(sum(ok) / len(ok), 4) if ok else None}
