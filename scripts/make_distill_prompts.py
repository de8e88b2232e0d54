# ruff: noqa: E501  (prompt templates read best one per line)
"""Write data/distill-prompts.jsonl: the instruction set `specdecode distill-data` answers with the
target to train a drafter (self-distillation). Built from the Python standard library's module
docstrings, a topic list written here and the shared Three Kingdoms corpus; none of it comes
from Spec-Bench (tests/test_distill.py checks that no evaluation prompt appears).

    python scripts/make_distill_prompts.py [--corpus ../shared/corpora/three_kingdoms.txt]

Deterministic for a given Python version (the docstrings come from the running interpreter).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
import sys
import warnings
from pathlib import Path

TOPICS = """the water cycle; volcanoes; black holes; photosynthesis; the French Revolution; the printing press;
honey bees; coral reefs; the Silk Road; climate change; electric cars; the human heart; sleep; vaccines;
the Roman Empire; the Moon landing; jazz; chess; the Internet; recycling; deserts; rainforests; glaciers;
earthquakes; the stock market; inflation; renewable energy; nuclear power; the immune system; DNA;
the periodic table; gravity; rainbows; the seasons; coffee; tea; bread baking; marathon training;
learning a new language; public libraries; city parks; bicycles; trains; airplanes; submarines;
the Great Wall of China; ancient Egypt; the Renaissance; Shakespeare; classical music; photography;
smartphones; social media; remote work; time management; budgeting; saving for retirement;
healthy breakfasts; houseplants; composting; dogs; cats; owls; whales; octopuses; ants; mountains;
rivers; oceans; the Arctic; the Amazon; Mars; Jupiter; comets; telescopes; microscopes; robots;
artificial intelligence; databases; encryption; open-source software; video games; board games;
volunteering; friendship; kindness; public speaking; job interviews; writing a resume; first aid;
fire safety; recycling plastic; clean water; farming; bees and pollination; the history of money;
museums; architecture; bridges; skyscrapers; the Olympic Games; football; basketball; swimming;
yoga; meditation; memory; habits; curiosity; teamwork; leadership; negotiation; customer service;
small businesses; supply chains; shipping containers; weather forecasting; hurricanes; tornadoes""".split(";")
TOPICS = [t.strip() for t in TOPICS if t.strip()]

ROLES = [
    "a ship captain",
    "a museum guide",
    "a chef",
    "a park ranger",
    "a detective",
    "a science teacher",
    "a travel agent",
    "a medieval knight",
    "a librarian",
    "an astronaut",
    "a gardener",
    "a coach",
]
LANGS = ["French", "German", "Spanish", "Italian"]

GENERAL = [
    "Write a short story about {t}.",
    "Write a persuasive paragraph about why people should care about {t}.",
    "Write a blog post introduction about {t}.",
    "Write a haiku and a limerick about {t}.",
    "Pretend you are {r}. Explain {t} to a group of visitors.",
    "You are {r}. A child asks you about {t}. What do you say?",
    "Explain {t} to a ten-year-old.",
    "Give three surprising facts about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Write a short dialogue between two friends discussing {t}.",
    "Summarize the history of {t} in one paragraph.",
    "Create a five-question quiz about {t}, with answers.",
    "Write a formal email inviting colleagues to a talk about {t}.",
    "List five tips for someone who wants to learn about {t}.",
    "Compare {t} and {u}: how are they alike and how are they different?",
    "Describe a day in the life of {r} who is interested in {t}.",
    'Translate into {lang}: "I would like to learn more about {t}."',
    "Write a product description for a book about {t}.",
    "What questions would a scientist ask about {t}? List them and explain why.",
    "Outline a presentation about {t} with an introduction, three sections and a conclusion.",
]

STDLIB = [
    "Explain what Python's `{m}` module is for and show a short example.",
    "Write a Python function that uses the `{m}` module, with a docstring and a usage example.",
    "Summarize this documentation in two sentences:\n\n{doc}",
    "Read the text below and answer the question.\n\n{doc}\n\nQuestion: what is `{m}` used for?",
    "What are common mistakes when using `{m}.{f}` in Python? {line}",
    "Write a unit test for a function that calls `{m}.{f}`. The function's documentation says: {line}",
    "Explain this Python documentation to a beginner:\n\n{line}",
    "Translate into {lang}: {line}",
]


def words(n: int, rng: random.Random) -> list[int]:
    return [rng.randint(2, 60) for _ in range(n)]


def math_prompts(rng: random.Random, n: int) -> list[str]:
    things = ["apples", "books", "marbles", "stickers", "cookies", "pencils", "coins", "cards"]
    names = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun"]
    out = []
    for _ in range(n):
        a, b, c = words(3, rng)
        x, y = rng.sample(names, 2)
        t = rng.choice(things)
        out.append(
            rng.choice(
                [
                    f"{x} has {a} {t}. {y} gives {x} {b} more, then {x} gives away {c}. How many {t} does {x} have? Explain step by step.",
                    f"A box holds {a} {t}. How many {t} are in {b} boxes, and how many boxes are needed for {a * b + c} {t}? Show your work.",
                    f"{x} reads {a} pages a day. How many days does {x} need to read a book of {a * b + c} pages? Think step by step.",
                    f"What is {a} times {b}, plus {c}? Explain each step.",
                    f"{x} earns ${a} an hour and works {b} hours. {x} spends ${c}. How much money is left? Reason step by step.",
                ]
            )
        )
    return out


def stdlib_prompts(rng: random.Random) -> list[str]:
    out = []
    skip = {"this", "antigravity", "idlelib", "turtle", "turtledemo", "tkinter", "pydoc_data"}
    names = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in skip)
    warnings.simplefilter("ignore")
    for m in names:
        try:
            mod = importlib.import_module(m)
        except Exception:  # platform-specific modules
            continue
        doc = inspect.getdoc(mod) or ""
        doc = re.sub(r"\s+\n", "\n", doc).strip()[:900]
        funcs = [
            (k, inspect.getdoc(v) or "")
            for k, v in vars(mod).items()
            if not k.startswith("_") and callable(v) and getattr(v, "__module__", None) == m
        ]
        funcs = [(k, d.split("\n")[0]) for k, d in funcs if len(d) > 20]
        if len(doc) < 40 and not funcs:
            continue
        rng.shuffle(funcs)
        for f, line in funcs[:3] or [("", doc.split("\n")[0])]:
            tpl = rng.choice(STDLIB if funcs and len(doc) >= 40 else STDLIB[:2])
            out.append(tpl.format(m=m, f=f, doc=doc, line=line, lang=rng.choice(LANGS)))
    return out


def corpus_prompts(path: Path, rng: random.Random, n: int) -> list[str]:
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    sents = [s.strip().lstrip("」』") for s in re.split(r"(?<=[。！？])", text)]
    sents = [s for s in sents if 12 <= len(s) <= 80]
    out = []
    for _ in range(n):
        i = rng.randrange(len(sents) - 6)
        passage = "".join(sents[i : i + 5])
        out.append(
            rng.choice(
                [
                    f"Translate into English: {sents[i]}",
                    f"Summarize this passage from Romance of the Three Kingdoms in English:\n\n{passage}",
                    f"Who are the people mentioned in this passage, and what happens? Answer in English.\n\n{passage}",
                ]
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="../shared/corpora/three_kingdoms.txt")
    ap.add_argument("--out", default="data/distill-prompts.jsonl")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompts = []
    for tpl in GENERAL:
        for t in TOPICS:
            if rng.random() < 0.6:
                u = rng.choice([x for x in TOPICS if x != t])
                prompts.append(tpl.format(t=t, u=u, r=rng.choice(ROLES), lang=rng.choice(LANGS)))
    prompts += stdlib_prompts(rng)
    prompts += math_prompts(rng, 300)
    prompts += corpus_prompts(Path(args.corpus), rng, 200)
    prompts = list(dict.fromkeys(prompts))
    rng.shuffle(prompts)
    with open(args.out, "w", encoding="utf-8") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": i, "prompt": p}, ensure_ascii=False) + "\n")
    print(f"wrote {len(prompts)} prompts to {args.out}")


if __name__ == "__main__":
    main()
