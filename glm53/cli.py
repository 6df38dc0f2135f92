"""The `glm53` command. Each subcommand lives in its own module and registers itself
through `add_parser(subparsers)`, setting `func` on its parser."""

from __future__ import annotations

import argparse
import sys

from glm53 import __version__


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at the top: a worker that `glm53 synth --jobs` spawns imports this
    # module again (it is the main script's) and needs none of them (together about 0.6 s,
    # rich included).
    from glm53 import download, reference_cli, serve
    from glm53.doctor import cli as doctor_cli
    from glm53.store import cli as store_cli
    from glm53.synth import cli as synth_cli

    parser = argparse.ArgumentParser(
        prog="glm53",
        description="Serve GLM-5.3-Flash from one small GPU, with its experts tiered over "
        "VRAM, pinned RAM, an NVMe store and a CPU lane.",
    )
    parser.add_argument("--version", action="version", version=f"glm53 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (serve, synth_cli, doctor_cli, download, store_cli, reference_cli):
        module.add_parser(sub)
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
