"""The `glm53` command. Each subcommand lives in its own module and registers itself
through `add_parser(subparsers)`; the module is imported only when listed here."""

from __future__ import annotations

import argparse
import importlib
import sys

from glm53 import __version__

# name -> module that defines add_parser(subparsers) and sets `func` on its parser
SUBCOMMANDS: dict[str, str] = {
    "serve": "glm53.serve",
    "synth": "glm53.synth.cli",
    "doctor": "glm53.doctor.cli",
    "download": "glm53.download",
    "store": "glm53.store.cli",
    "reference": "glm53.reference_cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glm53",
        description="Serve GLM-5.3-Flash from one small GPU, with its experts tiered over "
        "VRAM, pinned RAM, an NVMe store and a CPU lane.",
    )
    parser.add_argument("--version", action="version", version=f"glm53 {__version__}")
    if SUBCOMMANDS:
        sub = parser.add_subparsers(dest="command", metavar="COMMAND")
        for module in SUBCOMMANDS.values():
            importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0 if argv is None and len(sys.argv) <= 1 else 2
    return int(func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
