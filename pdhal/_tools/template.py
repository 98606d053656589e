"""`pdhal new-backend NAME`: a new backend distribution written from the template shipped
in the wheel (pdhal/_tools/backend_template), ready to install and to pass the conformance kit,
with each piece to replace marked."""

from __future__ import annotations

import os
import re

from pdhal._errors import InvalidArgumentError

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "backend_template")
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def write(name: str, into: str = ".") -> str:
    """Write the distribution pdhal-NAME (package pdhal_NAME, entry point NAME in
    pdhal.backends) into `into`; returns its folder. Never overwrites."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name == "cpu":
        raise InvalidArgumentError(
            f"a backend name is 1-32 of lowercase letters, digits and '_', starting with a "
            f"letter (it becomes PDHAL_PLATFORM's value and part of a Python package name), "
            f"and not 'cpu'; got {name!r}"
        )
    folder = os.path.join(into, f"pdhal-{name}")
    if os.path.exists(folder):
        raise InvalidArgumentError(f"{folder} exists already: choose another --into")
    words = {"{{name}}": name, "{{Name}}": name.title().replace("_", ""), "{{NAME}}": name.upper()}
    for root, _, files in os.walk(TEMPLATE):
        for file in sorted(files):
            if not file.endswith(".tmpl"):
                continue
            relative = os.path.relpath(os.path.join(root, file), TEMPLATE)[: -len(".tmpl")]
            target = os.path.join(
                folder,
                relative.replace("pkg", f"pdhal_{name}", 1)
                if relative.startswith("pkg")
                else relative,
            )
            with open(os.path.join(root, file)) as f:
                text = f.read()
            for placeholder, value in words.items():
                text = text.replace(placeholder, value)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "x") as f:
                f.write(text)
    return folder
