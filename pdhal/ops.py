"""The one module engine code imports: `from pdhal import ops`.

Every op is bound, on first use, to the active backend's own function object (selected
once, see pdhal.current_platform); later `ops.X` lookups are plain module attributes, with
no plugin dispatch on the per-layer path. copy_blocks copies block ids to block ids, ordered
on a stream; synchronize waits for it.

FastDeploy's own call shapes (int addresses, tensors for kernels) are pdhal.compat.fastdeploy.
"""

from pdhal._backends import optable
from pdhal._backends import registry as _registry

#: Every op, in the op table's order (pdhal._backends.optable declares them).
OP_NAMES = optable.OP_NAMES
__doc__ = (__doc__ or "") + "\nThe ops, by what they are for:\n\n" + optable.describe() + "\n"

__all__ = list(OP_NAMES)


def _bind() -> dict:
    table = _registry.selection().ops
    globals().update({name: table[name] for name in OP_NAMES})
    return table


def _unbind() -> None:
    for name in OP_NAMES:
        globals().pop(name, None)


_registry.on_reset(_unbind)


def __getattr__(name: str):
    if name not in OP_NAMES:
        raise AttributeError(f"pdhal.ops has no op {name!r}; ops: {', '.join(OP_NAMES)}")
    return _bind()[name]


def __dir__():
    return sorted(set(globals()) | set(OP_NAMES))
