"""The `specdecode` command: one module per subcommand, each with register(sub) that adds its
parser and sets func. Bad input: one line on stderr and exit code 2, no traceback."""

from __future__ import annotations

import sys

from ..errors import SpecDecodeError
from . import (
    bench,
    chat,
    demo,
    distill_data,
    draft_vocab,
    export,
    generate,
    import_gguf,
    init_model,
    lab,
    model_card,
    models,
    plan,
    serve,
    train,
    train_heads,
)
from .common import Parser

COMMANDS = (
    generate,
    chat,
    import_gguf,
    init_model,
    models,
    train,
    model_card,
    demo,
    distill_data,
    draft_vocab,
    train_heads,
    export,
    lab,
    plan,
    bench,
    serve,
)
# optional libraries and the extra that installs each
EXTRAS = {
    "gguf": "gguf",
    "transformers": "hf",
    "matplotlib": "lab",
    "scipy": "lab",
    "jinja2": "lab",
    "rich": "lab",
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "openvino": "openvino",
}


def build_parser() -> Parser:
    parser = Parser(
        prog="specdecode",
        description="Exact speculative decoding: a drafter proposes k tokens, the target checks "
        "them in one forward pass, and the output keeps the target's distribution.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecDecodeError as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        root = (e.name or "").split(".")[0]
        if root not in EXTRAS:
            raise
        print(
            f"specdecode: error: `specdecode {args.command}` needs {root}; install it with "
            f"pip install 'specdecode[{EXTRAS[root]}]' (or [all])",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
