"""Arguments a graph signature cannot hold, used through eager breaks instead of running the whole forward eagerly.

:func:`~bcg_diffusion.core.tree.flatten` turns tensors, plain values, containers and objects made of those
into static buffers and a signature. An argument it cannot flatten (an object holding a function, a
C type) is passed to the captured forward as an :class:`OpaqueArgument`: a stand-in that the runner
points at the call's real object before every run and replay. Each use of it is an eager break
(:func:`~bcg_diffusion.core.graphs.eager_break`) on the real object of that call:

* reading an attribute returns what the real object holds now: tensors through the break's bridges,
  Python values frozen into the segments after the break and checked at every replay (another value
  takes another captured path, see :mod:`bcg_diffusion.core.runner`);
* calling a method calls it on the real object, with the same rules for its result;
* an attribute that is itself not flattenable is another stand-in, resolved from its parent inside
  the breaks that use it; ``len()``, ``bool()``, indexing and calling the object are breaks too.

Only instances of classes written in Python are set aside this way (:func:`~bcg_diffusion.core.tree.pure_python`):
a stand-in for a C type (``torch.Generator``) would pass ``isinstance`` checks in C code that then reads
it as that type's struct, so such an argument keeps its whole forward eager, with a warning.

``isinstance`` sees the real object's class. What cannot work through a stand-in makes the capture
fail with the reason, and that signature runs eagerly: passing it to a torch function, iterating it,
setting its attributes, a method returning an object the tree cannot flatten.
"""

from __future__ import annotations

import types
from typing import Any

from .graphs import eager_break
from .tree import UnsupportedValue, flatten, pure_python

__all__ = ["OpaqueArgument"]

_METHOD_TYPES = (types.MethodType, types.BuiltinMethodType, types.MethodWrapperType)


class OpaqueArgument:
    """Stands for one argument the signature cannot hold (see the module docstring).

    ``point_at(obj)`` sets the real object for the next run or replay. ``stands_for`` is its class,
    which :func:`~bcg_diffusion.core.tree.flatten` puts in the signature in its place.
    """

    __slots__ = ("_bcg_target", "_bcg_parent", "_bcg_name", "stands_for")
    bcg_stand_in = True  # flatten() puts stands_for in the signature in its place

    def __init__(self, target: Any = None, parent: OpaqueArgument | None = None, name: str = "") -> None:
        object.__setattr__(self, "_bcg_target", target)
        object.__setattr__(self, "_bcg_parent", parent)
        object.__setattr__(self, "_bcg_name", name)
        object.__setattr__(self, "stands_for", type(target) if parent is None else type(_resolve(self)))

    @property
    def __class__(self) -> type:
        # isinstance() sees the real object's class: only classes written in Python get here, whose
        # objects no C code reads as a struct (flatten refuses the others; a nested one keeps its own)
        return self.stands_for if pure_python(self.stands_for) else OpaqueArgument

    def point_at(self, target: Any) -> None:
        object.__setattr__(self, "_bcg_target", target)

    def __getattr__(self, name: str) -> Any:
        value = getattr(_resolve(self), name)
        if isinstance(value, _METHOD_TYPES):
            return _Method(self, name)
        try:
            flatten(value)
        except UnsupportedValue:
            return OpaqueArgument(parent=self, name=name)
        return _read(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError(
            f"bcg-diffusion: the forward sets {name!r} on an argument of type {self.stands_for.__qualname__} that a "
            "graph cannot hold; such a call runs eagerly"
        )

    def __getitem__(self, key: Any) -> Any:
        return _call(self, "__getitem__", (key,), {})

    def __len__(self) -> int:
        return _call(self, "__len__", (), {})

    def __bool__(self) -> bool:
        return _truth(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _call(self, "__call__", args, kwargs)

    def __repr__(self) -> str:
        return f"OpaqueArgument({self.stands_for.__qualname__})"


class _Method:
    """A method of the real object, called through an eager break."""

    __slots__ = ("owner", "name")

    def __init__(self, owner: OpaqueArgument, name: str) -> None:
        self.owner, self.name = owner, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _call(self.owner, self.name, args, kwargs)


def _resolve(stand_in: OpaqueArgument) -> Any:
    """The real object ``stand_in`` stands for now."""
    parent = object.__getattribute__(stand_in, "_bcg_parent")
    if parent is None:
        return object.__getattribute__(stand_in, "_bcg_target")
    return getattr(_resolve(parent), object.__getattribute__(stand_in, "_bcg_name"))


@eager_break
def _read(stand_in: OpaqueArgument, name: str) -> Any:
    return getattr(_resolve(stand_in), name)


@eager_break
def _call(stand_in: OpaqueArgument, name: str, args: tuple, kwargs: dict) -> Any:
    return getattr(_resolve(stand_in), name)(*args, **kwargs)


@eager_break
def _truth(stand_in: OpaqueArgument) -> bool:
    return bool(_resolve(stand_in))
