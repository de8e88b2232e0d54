"""The benchmark's prompt sets: prose (three-kingdoms), code (python-code) and an edit/repeat
set per family whose output copies much of the prompt.

Nothing is downloaded or copied into the repository: the code prompts are function openings
in the style of the python-code corpus (the running Python's standard library). An edit prompt
is a passage the target itself wrote greedily from one of the family's prompts, then that
prompt again: greedy decoding re-derives the passage, so the output repeats text that is
already in the context (what rewriting a document or code with small edits looks like). The
bundled targets are too small to copy an arbitrary passage (no induction behaviour: fed
standard-library source twice, they drift after a few tokens), so the passage must be theirs.
"""

from __future__ import annotations

from ..lab.common import PROMPTS as PROSE

CODE = (
    "def __init__(self, ",
    "import os\nimport sys\n\n\ndef main(",
    "    def __repr__(self):\n        return ",
    "class Error(Exception):\n    ",
)
SETS = {"three-kingdoms": ("prose", "edit"), "python-code": ("code", "edit")}


def edit_prompt(opening: str, passage: str) -> str:
    """The opening and the passage that followed it, then the opening again."""
    return opening + passage + "\n\n" + opening


def prompts(family: str, name: str, target=None, count: int = 4) -> list[str]:
    """`count` prompts of set `name` for a family. The edit set asks the family's target (the
    loaded model) for its greedy passages: deterministic, built in well under a second."""
    if name == "prose":
        return list(PROSE[:count])
    if name == "code":
        return list(CODE[:count])
    if name != "edit":
        raise ValueError(f"unknown prompt set {name!r}")
    from ..core.sampling import SamplingParams
    from ..engine import SpeculativeGenerator

    openings = list((CODE if family == "python-code" else PROSE)[:count])
    params = SamplingParams(temperature=0, max_new_tokens=96, ignore_eos=True)
    gen = SpeculativeGenerator(target)
    return [edit_prompt(p, gen.generate([p], params)[0].text) for p in openings]
