"""The benchmark's prompt sets: prose (three-kingdoms), code (python-code) and an edit/repeat
set per family whose output copies much of the prompt.

Nothing is downloaded or copied into the repository: the code prompts are function openings
in the style of the python-code corpus (the running Python's standard library), the edit
passages are read from that library (code) or written by the bundled target itself (prose).
"""

from __future__ import annotations

import inspect
import textwrap

from ..lab.common import PROMPTS as PROSE

CODE = (
    "def __init__(self, ",
    "import os\nimport sys\n\n\ndef main(",
    "    def __repr__(self):\n        return ",
    "class Error(Exception):\n    ",
)
SETS = {"three-kingdoms": ("prose", "edit"), "python-code": ("code", "edit")}
EDIT_SOURCES = ("textwrap.dedent", "shlex.quote", "fnmatch.translate", "difflib.get_close_matches")


def _source(qualname: str, max_chars: int) -> str:
    import importlib

    module, name = qualname.rsplit(".", 1)
    text = textwrap.dedent(inspect.getsource(getattr(importlib.import_module(module), name)))
    return text[:max_chars].rsplit("\n", 1)[0] + "\n"


def edit_prompt(passage: str) -> str:
    """The passage, then its first quarter again: continuing it means copying the rest."""
    return passage + "\n\n" + passage[: max(1, len(passage) // 4)]


def prompts(family: str, name: str, target=None, count: int = 4, max_chars: int = 600) -> list[str]:
    """`count` prompts of set `name` for a family. The prose edit set asks the target for its
    own greedy passages (deterministic), so it needs the loaded target."""
    if name == "prose":
        return list(PROSE[:count])
    if name == "code":
        return list(CODE[:count])
    if name != "edit":
        raise ValueError(f"unknown prompt set {name!r}")
    if family == "python-code":
        return [edit_prompt(_source(q, max_chars)) for q in EDIT_SOURCES[:count]]
    from ..engine import SpeculativeGenerator
    from ..sampling import SamplingParams

    gen = SpeculativeGenerator(target)
    params = SamplingParams(temperature=0, max_new_tokens=96, ignore_eos=True)
    return [edit_prompt(p + r.text) for p, r in zip(PROSE[:count], gen.generate(list(PROSE[:count]), params))]
