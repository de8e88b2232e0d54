"""What every command shares: the argument parser that exits 2 in one line, number lists, and
printing an experiment's result (table, --json, --plot)."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import SpecDecodeError


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def numbers(text: str, flag: str, kind=float) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecDecodeError(f"{flag} must be comma-separated numbers, got {text!r}") from None


def show(result, args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.plot:
        result.save_plot(args.plot)
    if args.json:
        print(json.dumps(result.to_json(), ensure_ascii=False, default=float))
    else:
        result.print(Console() if sys.stdout.isatty() else Console(width=200))
        if args.plot:
            print(f"wrote {args.plot}", file=sys.stderr)
    return 0
