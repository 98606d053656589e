"""The `pdhal` command: info, cleanup, new-backend, and the commands other distributions add.

A distribution adds a command with an entry point in the `pdhal.commands` group, named as the
command, whose module implements the `pdhal_command` hook (`@pdhal.hookimpl`): it returns a
`pdhal.plugin.Command` of the help line, `add_arguments(parser)` (cheap: it imports nothing
heavy, since `pdhal --help` runs it) and `main(args) -> int` (the exit status). `pdhal info`
and `pdhal cleanup` import no such module; one that fails to load is reported on stderr and
skipped.

Errors are one line, `pdhal: error: ...`: exit status 2 for a usage error, 1 for a failure at
run time; `--debug` (or PDHAL_DEBUG=1) shows the traceback too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from pdhal._backends.hookspecs import Command

COMMANDS_GROUP = "pdhal.commands"
BUILTIN = ("info", "cleanup", "new-backend")
#: What to install for a command that lives in another distribution of this repository.
_NOT_INSTALLED = {
    "demo": "pip install pdhal-demo (in a pdhal checkout: pip install -e demo)",
}


def _info(args) -> int:
    from pdhal._tools import info as _info

    info = _info.report()
    print(json.dumps(info, indent=2) if args.json else _info.format_text(info))
    return 0 if info["selected"] else 1


def _cleanup(args) -> int:
    from pdhal._protocol import cleanup as _cleanup

    removed, alive = _cleanup.cleanup(args.namespace, dry_run=args.dry_run)
    for path in removed:
        print(f"{'would remove' if args.dry_run else 'removed'} {path}")
    print(
        f"{len(removed)} dead segment(s) {'to remove' if args.dry_run else 'removed'}, "
        f"{len(alive)} live segment(s) left alone"
    )
    return 0


def _new_backend(args) -> int:
    from pdhal._tools import template as _template

    folder = _template.write(args.name, args.into)
    print(
        f"wrote the backend distribution pdhal-{args.name} in {folder}; next:\n"
        f"  pip install -e {folder}\n  pytest --pdhal-backend {args.name}   # the "
        f"conformance kit\nthen replace what each '# Replace:' comment points at"
    )
    return 0


def _command_entry_points() -> dict:
    """{command: entry point} of the `pdhal.commands` group (metadata only, nothing imported);
    a name already taken (built in, or by another distribution) is reported and skipped."""
    from importlib import metadata

    found: dict = {}
    for ep in metadata.entry_points(group=COMMANDS_GROUP):
        if ep.name in BUILTIN:
            print(
                f"pdhal: command {ep.name!r} ({_origin(ep)}) is skipped: it is built in",
                file=sys.stderr,
            )
        elif ep.name in found and found[ep.name].value != ep.value:
            print(
                f"pdhal: command {ep.name!r} ({_origin(ep)}) is skipped: "
                f"{_origin(found[ep.name])} provides it",
                file=sys.stderr,
            )
        else:
            found.setdefault(ep.name, ep)
    return found


def _origin(ep) -> str:
    dist = getattr(ep, "dist", None)
    return f"{ep.value}, from {dist.name} {dist.version}" if dist else ep.value


def _add_command(sub, ep):
    """Load `ep`'s plugin and add its subcommand (its parser); on any failure say why and
    add nothing (None)."""
    from pdhal._backends import plugins

    try:
        command = plugins.provide(COMMANDS_GROUP, ep.name, ep.load)
        if not isinstance(command, Command):
            raise TypeError(f"pdhal_command returned {command!r}, expected a pdhal.plugin.Command")
        # Filled apart first, so a parser that fails half-way is never registered.
        options = argparse.ArgumentParser(add_help=False)
        command.add_arguments(options)
        p = sub.add_parser(ep.name, parents=[options], help=command.help, description=command.help)
    except Exception as exc:  # a broken command must never take `pdhal` down
        print(
            f"pdhal: command {ep.name!r} ({_origin(ep)}) failed to load and is skipped: "
            f"{type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return None
    p.set_defaults(func=command.main)
    return p


class _Parser(argparse.ArgumentParser):
    """argparse, with every option's default in its help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def _version() -> str:
    from pdhal._version import __version__

    return f"pdhal {__version__}"


def build_parser(plugins: dict) -> tuple[argparse.ArgumentParser, dict]:
    """The parser and its subcommand parsers by name (plugins: entry points to add)."""
    parser = _Parser(prog="pdhal", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument(
        "--debug", action="store_true", help="show tracebacks of errors (also PDHAL_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    commands = {}
    p = commands["info"] = sub.add_parser(
        "info",
        help="this machine and pdhal: backends, devices, segments folder, limits, "
        "PDHAL_* variables (as `vllm collect-env` does)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_info)
    p = commands["cleanup"] = sub.add_parser(
        "cleanup", help="remove this user's segments whose producer died"
    )
    p.add_argument("--dry-run", action="store_true", help="list them, remove nothing")
    p.add_argument(
        "--namespace",
        default=None,
        help="only this namespace (default: every namespace of this user)",
    )
    p.set_defaults(func=_cleanup)
    p = commands["new-backend"] = sub.add_parser(
        "new-backend", help="write a new backend distribution from pdhal's template"
    )
    p.add_argument("name", help="the backend's name (PDHAL_PLATFORM=NAME selects it)")
    p.add_argument("--into", default=".", help="folder to create pdhal-NAME in")
    p.set_defaults(func=_new_backend)
    for name, ep in plugins.items():
        added = _add_command(sub, ep)
        if added is not None:
            commands[name] = added
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get("PDHAL_DEBUG", "") not in ("", "0")
    # The command is the first word (pdhal itself has only flags); None: help or an error.
    command = next((a for a in argv if not a.startswith("-")), None)
    plugins = {} if command in BUILTIN else _command_entry_points()
    if command is not None and command not in BUILTIN:
        if command in plugins:
            plugins = {command: plugins[command]}  # load only the command that runs
        elif command in _NOT_INSTALLED:
            print(
                f"pdhal: error: `pdhal {command}` is not installed: {_NOT_INSTALLED[command]}",
                file=sys.stderr,
            )
            return 2
    parser, commands = build_parser(plugins)
    if command in plugins and command not in commands:
        return 2  # it failed to load, and said why
    args, extra = parser.parse_known_args(argv)
    if extra:  # told by the command's own parser, with its own usage
        commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("pdhal: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, unless asked for the traceback
        from pdhal import PdhalError

        if debug:
            traceback.print_exc()
        what = "error" if isinstance(e, PdhalError) else f"internal error ({type(e).__name__})"
        hint = "" if debug else " (--debug for the traceback)"
        print(f"pdhal: {what}: {e}{hint if not isinstance(e, PdhalError) else ''}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
