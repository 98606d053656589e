"""The `pdhal` command: info, cleanup, and the commands other distributions add.

A distribution adds a command with an entry point in the `pdhal.commands` group, named as the
command, whose module has `add_arguments(parser)` (cheap: it imports nothing heavy, since
`pdhal --help` runs it), `main(args) -> int` (the exit status) and, for `pdhal --help`, a
`HELP` string (else its docstring's first line). `pdhal info` and `pdhal cleanup` import no
such module; one that fails to load is reported on stderr and skipped.
"""

from __future__ import annotations

import argparse
import json
import sys

COMMANDS_GROUP = "pdhal.commands"
BUILTIN = ("info", "cleanup")
#: What to install for a command that lives in another distribution of this repository.
_NOT_INSTALLED = {
    "demo": "pip install pdhal-demo (in a pdhal checkout: pip install -e demo)",
}


def _info(args) -> int:
    from pdhal import _info

    info = _info.report()
    print(json.dumps(info, indent=2) if args.json else _info.format_text(info))
    return 0 if info["selected"] else 1


def _cleanup(args) -> int:
    from pdhal import cleanup

    removed, alive = cleanup()
    for path in removed:
        print(f"removed {path}")
    print(f"{len(removed)} dead segment(s) removed, {len(alive)} live segment(s) left alone")
    return 0


def _command_entry_points() -> dict:
    """{command: entry point} of the `pdhal.commands` group (metadata only, nothing imported);
    a name already taken (built in, or by another distribution) is reported and skipped."""
    from importlib import metadata

    found: dict = {}
    for ep in metadata.entry_points(group=COMMANDS_GROUP):
        if ep.name in BUILTIN:
            print(f"pdhal: command {ep.name!r} ({_origin(ep)}) is skipped: it is built in",
                  file=sys.stderr)
        elif ep.name in found and found[ep.name].value != ep.value:
            print(f"pdhal: command {ep.name!r} ({_origin(ep)}) is skipped: "
                  f"{_origin(found[ep.name])} provides it", file=sys.stderr)
        else:
            found.setdefault(ep.name, ep)
    return found


def _origin(ep) -> str:
    dist = getattr(ep, "dist", None)
    return f"{ep.value}, from {dist.name} {dist.version}" if dist else ep.value


def _add_command(sub, ep) -> bool:
    """Load `ep`'s module and add its subcommand; on any failure say why and add nothing."""
    try:
        module = ep.load()
        if not (callable(getattr(module, "add_arguments", None))
                and callable(getattr(module, "main", None))):
            raise TypeError("it needs add_arguments(parser) and main(args)")
        doc = (module.__doc__ or "").strip()
        help_line = getattr(module, "HELP", None) or doc.split("\n", 1)[0]
        # Filled apart first, so a parser that fails half-way is never registered.
        options = argparse.ArgumentParser(add_help=False)
        module.add_arguments(options)
        p = sub.add_parser(ep.name, parents=[options], help=help_line, description=help_line)
    except Exception as exc:  # a broken command must never take `pdhal` down
        print(f"pdhal: command {ep.name!r} ({_origin(ep)}) failed to load and is skipped: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return False
    p.set_defaults(func=module.main)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The command is the first word (pdhal itself has no options but -h); None: help or error.
    command = next((a for a in argv if not a.startswith("-")), None)
    plugins = {} if command in BUILTIN else _command_entry_points()
    if command is not None and command not in BUILTIN:
        if command in plugins:
            plugins = {command: plugins[command]}  # load only the command that runs
        elif command in _NOT_INSTALLED:
            print(f"pdhal: `pdhal {command}` is not installed: {_NOT_INSTALLED[command]}",
                  file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(prog="pdhal", description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="selected backend, discovered plugins, versions")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_info)
    p = sub.add_parser("cleanup", help="remove this user's segments whose producer died")
    p.set_defaults(func=_cleanup)
    for name, ep in plugins.items():
        if not _add_command(sub, ep) and name == command:
            return 2
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
