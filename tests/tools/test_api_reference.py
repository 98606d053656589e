"""The signatures docs/api.md documents are the real ones: parameter names, kinds and
defaults as inspect.signature gives them for the objects the guide names (pdhal.ops as the
cpu backend, the reference implementation, binds it). Objects are found by their public
paths only, so the check does not depend on where pdhal keeps its private modules.

A documented signature is, by the guide's own conventions:
- the first line under a heading that names one op or function: copy_blocks(...) in
  "pdhal.ops", pdhal.cleanup(...) in "Top-level functions of pdhal";
- in a class's section of "Classes", the code spans a bullet starts with (its methods) and
  any span ClassName(...) (its constructor).
A documented name that does not exist fails its test, and so does an entry whose signature
line is missing or is not a signature with literal defaults.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
from dataclasses import dataclass

import pytest

import pdhal
import pdhal.blocks
import pdhal.ops
import pdhal.transfer

API_MD = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs", "api.md")
SPAN = re.compile(r"`([^`]+)`")
#: The spans a bullet starts with: `a()`, `b()` (a remark), `c` ...
LEADING_SPAN = re.compile(r"\s*`([^`]+)`(?:\s*\([^)]*\))?\s*(,)?")


@dataclass(frozen=True)
class Documented:
    line: int  # 1-based, in api.md
    path: str  # the public path it documents, e.g. "pdhal.ops.copy_blocks"
    text: str  # the signature as written
    params: str | None  # the text between its parentheses; None: no signature found


def split_call(text: str) -> tuple[str, str] | None:
    """(name, parameter text) of `name(params)` or `name(params) -> ret`, else None."""
    m = re.match(r"([A-Za-z_][\w.]*)\(", text)
    if not m:
        return None
    depth = 0
    for i in range(m.end() - 1, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            rest = text[i + 1 :].strip()
            if rest and not rest.startswith("->"):
                return None
            return m[1], text[m.end() : i]
    return None


@dataclass
class Block:
    """A heading of api.md and the lines under it, up to the next heading (code blocks
    left out)."""

    level: int
    title: str
    section: str  # the `##` heading it is under
    body: list[tuple[int, str]]  # (1-based line number, text)


def blocks(path: str = API_MD) -> list[Block]:
    with open(path) as f:
        lines = f.read().splitlines()
    out, section, in_code = [], "", False
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"(#{2,4}) (.*)", line)
        if heading:
            level, title = len(heading[1]), heading[2].strip()
            section = title if level == 2 else section
            out.append(Block(level, title, section, []))
        elif out and not in_code:
            out[-1].body.append((number, line))
    return out


def parse_api_md(path: str = API_MD) -> tuple[list[Documented], dict[str, list[str]]]:
    """Every documented signature, and the names each `##` section gives a `####` entry."""
    found, entries = [], {}
    for block in blocks(path):
        names = SPAN.findall(block.title)
        if block.level == 4:
            entries.setdefault(block.section, []).extend(names)
            if len(names) == 1:
                found.append(_entry_signature(names[0], block))
        elif block.level == 3 and block.section == "Classes" and len(names) == 1:
            found.extend(_class_signatures(names[0], block))
    return found, entries


def _entry_signature(name: str, block: Block) -> Documented:
    """The signature line of the `####` entry `name`: the first line under its heading."""
    number, first = next(((n, line) for n, line in block.body if line.strip()), (0, ""))
    m = re.match(r"`([^`]+)`", first)
    call = split_call(m[1]) if m else None
    qualifier = "pdhal.ops." if block.section == "`pdhal.ops`" else ""
    if call is None or call[0].rpartition(".")[2] != name:
        return Documented(number, qualifier + name, first, None)
    return Documented(number, qualifier + call[0], m[1], call[1])


def _class_signatures(cls: str, block: Block) -> list[Documented]:
    """The signatures of `cls`'s section: its bullets' leading spans, its constructor."""
    out = []
    for number, line in block.body:
        if not line.startswith("- "):
            continue
        pos = 2
        while m := LEADING_SPAN.match(line, pos):
            call = split_call(m[1])
            if call and call[0] != cls:
                out.append(Documented(number, f"pdhal.{cls}.{call[0]}", m[1], call[1]))
            if not m[2]:
                break
            pos = m.end()
    # A constructor's span may wrap onto the next line: search the section as one text.
    text = "\n".join(line for _, line in block.body)
    for m in SPAN.finditer(text):
        span = " ".join(m[1].split())
        call = split_call(span)
        if call and call[0] == cls:
            number = block.body[text.count("\n", 0, m.start())][0]
            out.append(Documented(number, f"pdhal.{cls}", span, call[1]))
    return out


DOCUMENTED, ENTRIES = parse_api_md()


def resolve(path: str):
    """The object at a public dotted path from pdhal, and the class it is a member of."""
    obj, owner = pdhal, None
    for part in path.split(".")[1:]:
        owner = obj if inspect.isclass(obj) else None
        obj = getattr(obj, part)
    return obj, owner


NO_DEFAULT = repr(inspect.Parameter.empty)


def real_params(path: str) -> list[tuple[str, str, str]]:
    """(name, kind, repr of the default) of each parameter of the object at `path` (self left
    out). Defaults compare by repr, so that 0 is not False and 60 not 60.0."""
    obj, owner = resolve(path)
    params = list(inspect.signature(obj).parameters.values())
    if owner is not None and inspect.isfunction(inspect.getattr_static(owner, path.split(".")[-1])):
        params = params[1:]  # a plain method: self
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "positional-only",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.VAR_POSITIONAL: "*args",
        inspect.Parameter.KEYWORD_ONLY: "keyword-only",
        inspect.Parameter.VAR_KEYWORD: "**kwargs",
    }
    return [(p.name, kinds[p.kind], repr(p.default)) for p in params]


def documented_params(params: str) -> list[tuple[str, str, str]]:
    """The same triples for a signature as the guide writes it (defaults must be literals)."""
    args = ast.parse(f"def _({params}): pass").body[0].args
    positional = args.posonlyargs + args.args
    defaults = [NO_DEFAULT] * (len(positional) - len(args.defaults))
    defaults += [repr(ast.literal_eval(d)) for d in args.defaults]
    out = [
        (a.arg, "positional-only" if a in args.posonlyargs else "positional", d)
        for a, d in zip(positional, defaults)
    ]
    if args.vararg:
        out.append((args.vararg.arg, "*args", NO_DEFAULT))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append((a.arg, "keyword-only", NO_DEFAULT if d is None else repr(ast.literal_eval(d))))
    if args.kwarg:
        out.append((args.kwarg.arg, "**kwargs", NO_DEFAULT))
    return out


@pytest.fixture
def cpu_ops(monkeypatch):
    """pdhal.ops bound to the cpu backend, the reference implementation the guide follows."""
    monkeypatch.setenv("PDHAL_PLATFORM", "cpu")
    assert pdhal.current_backend() == "cpu"


def test_the_guide_documents_signatures():
    """The parser still understands api.md: a format change must not empty this check."""
    assert len(DOCUMENTED) >= 50
    assert {d.path.rpartition(".")[0] for d in DOCUMENTED} >= {
        "pdhal",
        "pdhal.ops",
        "pdhal.Platform",
    }


@pytest.mark.parametrize("doc", DOCUMENTED, ids=lambda d: f"{d.path}@{d.line}")
def test_documented_signature_is_the_real_one(doc: Documented, cpu_ops):
    where = f"api.md:{doc.line} documents {doc.path}"
    assert doc.params is not None, (
        f"{where} without a signature line `{doc.path.split('.')[-1]}(...)`: {doc.text!r}"
    )
    try:
        resolve(doc.path)
    except AttributeError:
        pytest.fail(f"{where}, which does not exist")
    try:
        documented = documented_params(doc.params)
    except (SyntaxError, ValueError) as e:
        pytest.fail(f"{where} as `{doc.text}`, which is not a signature with literal defaults: {e}")
    assert documented == real_params(doc.path), f"{where} as `{doc.text}`"


def test_every_op_has_an_entry():
    assert sorted(ENTRIES["`pdhal.ops`"]) == sorted(pdhal.ops.OP_NAMES)


def test_every_top_level_function_has_an_entry():
    functions = [n for n in pdhal.__all__ if inspect.isfunction(getattr(pdhal, n))]
    assert set(functions) <= set(ENTRIES["Top-level functions of `pdhal`"])
