"""MkDocs hook: the reference pages that mkdocstrings cannot render, pdhal.ops and pdhal.h.

pdhal.ops defines no functions: each name of OP_NAMES is bound, on first use, to the
selected backend's function, so static analysis finds nothing to document. This hook
selects the cpu backend (the reference implementation), imports pdhal and documents each
op from the bound function object itself (inspect.signature and its docstring). That names
no module path, so the page survives pdhal's private modules moving. pdhal.h's comments are
its documentation: the page shows the header's declarations with them, section by section.

The guides also link to repository files outside docs/ (../CHANGELOG.md), which GitHub
shows but the site does not have: such a link becomes its text and the file's path.
"""

from __future__ import annotations

import inspect
import os
import re

from mkdocs.exceptions import PluginError

# Replaced, in the page that holds it, by what the function after it renders.
OPS_MARKER = "<!-- generated: pdhal.ops -->"
HEADER_MARKER = "<!-- generated: pdhal.h -->"

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
HEADER = os.path.join(ROOT, "pdhal", "include", "pdhal.h")
LINK = re.compile(r"\[([^\]]+)\]\(([^)#\s]+)(#[^)\s]*)?\)")


def on_config(config):
    """pdhal.ops is documented as the cpu backend binds it, whatever this machine has."""
    os.environ["PDHAL_PLATFORM"] = "cpu"
    return config


def on_page_markdown(markdown: str, page, config, **kwargs) -> str:
    for marker, render in ((OPS_MARKER, render_ops), (HEADER_MARKER, render_header)):
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return LINK.sub(lambda m: outside_link(m, page, config["docs_dir"]), markdown)


def outside_link(m: re.Match, page, docs_dir: str) -> str:
    """A link to a repository file outside docs/ as text; any other link as it is (a broken
    one stays, for mkdocs to report)."""
    target = os.path.normpath(os.path.join(os.path.dirname(page.file.abs_src_path), m[2]))
    inside = os.path.commonpath([target, os.path.abspath(docs_dir)]) == os.path.abspath(docs_dir)
    if inside or "://" in m[2] or not os.path.exists(target):
        return m[0]
    return f"{m[1]} (`{os.path.relpath(target, ROOT)}` in the repository)"


class _Text(str):
    """An annotation shown as written: the modules use `from __future__ import annotations`,
    so annotations are strings, which inspect would otherwise show quoted."""

    def __repr__(self) -> str:
        return str(self)


def signature(func) -> str:
    """`name(params) -> return`, the way the guide writes signatures."""
    sig = inspect.signature(func)
    params = [
        p.replace(annotation=_Text(p.annotation)) if isinstance(p.annotation, str) else p
        for p in sig.parameters.values()
    ]
    ret = sig.return_annotation
    sig = sig.replace(
        parameters=params, return_annotation=_Text(ret) if isinstance(ret, str) else ret
    )
    return f"{func.__name__}{sig}"


def render_ops() -> str:
    from pdhal import ops
    from pdhal.plugin import BACKEND_OPS

    out, first_name = [], {}
    for name in ops.OP_NAMES:
        func = getattr(ops, name)
        out.append(f"## `{name}`\n")
        if id(func) in first_name:
            same = first_name[id(func)]
            out.append(f"The same function object as [`{same}`](#{same}).\n")
            continue
        first_name[id(func)] = name
        if not inspect.getdoc(func):
            raise PluginError(f"pdhal.ops.{name} has no docstring")
        owner = (
            "A backend op: each backend implements it; shown here, the cpu backend's."
            if name in BACKEND_OPS
            else "pdhal's own: the same function on every backend."
        )
        out.append(f"```python\n{signature(func)}\n```\n\n*{owner}*\n\n{inspect.getdoc(func)}\n")
    return "\n".join(out)


def render_header() -> str:
    with open(HEADER) as f:
        text = f.read()
    intro = re.match(r"/\*.*?\*/", text, re.S)
    body = re.search(r"/\* PDHAL_CDEF_BEGIN \*/\n(.*?)/\* PDHAL_CDEF_END \*/", text, re.S)
    if not (intro and body):
        raise PluginError("pdhal.h: no leading comment or no PDHAL_CDEF_BEGIN/END region")
    out = [f"```c\n{intro[0]}\n```\n"]
    # Sections start at comments like `/* ---- segments (segment.c) ---- */`; the one of
    # kernel forms goes on as a longer comment, which keeps its `/*`.
    parts = re.split(r"^/\* ---- (.+?) ----", body.group(1), flags=re.M)
    sections = [("Constants and types", parts[0])]
    for title, rest in zip(parts[1::2], parts[2::2]):
        sections.append((title, rest[3:] if rest.startswith(" */") else "/*" + rest))
    for title, code in sections:
        out.append(f"## {title}\n\n```c\n{code.strip()}\n```\n")
    return "\n".join(out)
