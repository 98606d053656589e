"""The `pdhal` command: info, demo, cleanup."""

from __future__ import annotations

import argparse
import json
import sys


def _info(args) -> int:
    from pdhal import _info

    info = _info.report()
    print(json.dumps(info, indent=2) if args.json else _info.format_text(info))
    return 0 if info["selected"] else 1


def _demo(args) -> int:
    from pdhal import demo

    return demo.main(args)


def _cleanup(args) -> int:
    from pdhal import _cleanup

    removed, alive = _cleanup.cleanup()
    for path in removed:
        print(f"removed {path}")
    print(f"{len(removed)} dead segment(s) removed, {len(alive)} live segment(s) left alone")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdhal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="selected backend, discovered plugins, versions")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_info)
    p = sub.add_parser("demo", help="prefill worker -> cache messager -> decode, layer by layer")
    from pdhal.demo import add_arguments

    add_arguments(p)
    p.set_defaults(func=_demo)
    p = sub.add_parser("cleanup", help="remove this user's segments whose producer died")
    p.set_defaults(func=_cleanup)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
