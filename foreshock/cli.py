"""The `foreshock` command: one entry point whose subcommands each live beside the code they run.

Each module in COMMAND_MODULES has `register(subparsers)`, which adds its subcommands with
`set_defaults(run=...)`; `run(args, config_file)` returns the exit status. Modules keep their
top-level imports light so that `foreshock --help` stays fast. A subcommand's name is also the name of
its `[section]` in the config file and of its FORESHOCK_<SECTION>_* variables (foreshock/config.py).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from foreshock import __version__
from foreshock.config import ConfigError, check_environment, check_file, load_file

COMMAND_MODULES = (
    "foreshock.collectors.command",
    "foreshock.simulator.command",
    "foreshock.predictor.command",
    "foreshock.predictor.history_command",
    "foreshock.service.command",
    "foreshock.service.archive_command",
    "foreshock.goodput",
    "foreshock.demo",
)


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def _global_options(parser: argparse.ArgumentParser, default) -> None:
    """--config and --log-level, on the top parser (with their defaults) and on every subcommand's
    (SUPPRESS: given there, they override; not given, the top parser's value stands)."""
    parser.add_argument("--config", metavar="FILE", default=default(None),
                        help="TOML config file (default: $FORESHOCK_CONFIG)")
    parser.add_argument("--log-level", default=default("INFO"), choices=LOG_LEVELS)


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:   # argparse keeps subcommand parsers only here
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):   # aliases map to the same parser
                yield child
                yield from _subparsers(child)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="foreshock", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"foreshock {__version__}")
    _global_options(parser, lambda value: value)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that command is not part of this build
                continue
            raise
        module.register(sub)
    parser.set_defaults(commands=tuple(sub.choices))
    for child in _subparsers(parser):   # `foreshock train --config F` as well as `foreshock --config F train`
        _global_options(child, lambda value: argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        file_data = load_file(args.config)
        check_file(file_data, args.commands)
        check_environment(args.commands)
        return int(args.run(args, file_data) or 0)
    except ConfigError as exc:
        print(f"foreshock {args.command}: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
