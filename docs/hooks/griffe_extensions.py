"""Griffe extensions (mkdocstrings reads pdhal through griffe's static analysis) for two
things that analysis misses in pdhal's sources."""

from __future__ import annotations

import inspect

import griffe


class LazyExports(griffe.Extension):
    """`import pdhal` loads no compiled core, so some names of its __all__ (SignalMeta,
    HostBuffer, RECORD_WORDS, ...) come from a module __getattr__, which static analysis
    cannot follow. Each is resolved at build time from the imported object, not from a list
    of module paths, so the reference keeps working when the private modules move: a class
    or function becomes an alias of the place that defines it, a constant an attribute with
    its value."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        if pkg.path != "pdhal":
            return
        import pdhal

        for name in pkg.exports or ():
            if name in pkg.members:
                continue
            obj = getattr(pdhal, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                member = griffe.Alias(name, f"{obj.__module__}.{obj.__qualname__}")
            else:
                member = griffe.Attribute(name, value=repr(obj))
            pkg.set_member(name, member)


class CommentDocstrings(griffe.Extension):
    """pdhal documents attributes with `#:` comments above them (Sphinx's convention), which
    griffe does not read: they become the attribute's docstring."""

    def on_attribute(self, *, attr: griffe.Attribute, **kwargs) -> None:
        if attr.docstring or not attr.lineno:
            return
        lines = attr.lines_collection[attr.filepath]
        comment, above = [], attr.lineno - 2
        while above >= 0 and lines[above].lstrip().startswith("#:"):
            comment.insert(0, lines[above].lstrip()[2:].strip())
            above -= 1
        if comment:
            attr.docstring = griffe.Docstring("\n".join(comment), parent=attr)
