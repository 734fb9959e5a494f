"""Flatten call arguments and results into tensors plus a hashable structure.

A *spec* describes everything about a (nested) value except the contents of its tensors: container
types and lengths, dict keys, Python constants, and the shape, stride, dtype and device of every
tensor. Two calls with equal specs can replay the same CUDA graph, so the spec doubles as the
capture signature.

We do not use ``torch.utils._pytree`` here: its specs keep Python constants as opaque leaves rather
than hashing them, and we need a cheap, hashable key that includes them (``img_shapes`` lists,
``return_dict`` flags, ``None`` versus a mask tensor).

>>> import torch
>>> leaves, spec = flatten(([torch.zeros(2, 3)], {"scale": 1.0, "mask": None}))
>>> len(leaves)
1
>>> rebuilt = unflatten(spec, leaves)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable
from typing import Any

import torch

__all__ = ["UnsupportedValue", "describe", "differences", "flatten", "unflatten"]

_CONSTANT_TYPES = (bool, int, float, str, bytes, complex, type(None), torch.dtype, torch.device)

# Spec node tags. Tuples of small ints and strings hash fast and compare structurally.
_TENSOR, _CONST, _LIST, _TUPLE, _DICT, _OUTPUT, _OBJECT, _OPAQUE = "T", "C", "L", "U", "D", "O", "B", "Q"


class UnsupportedValue(TypeError):
    """Raised when a value cannot be part of a graph signature (an object we cannot copy or compare)."""


def _is_output_dataclass(value: Any) -> bool:
    # diffusers' BaseOutput is both an OrderedDict and a dataclass; rebuild it by keyword.
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


@functools.lru_cache(maxsize=256)
def pure_python(cls: type) -> bool:
    """Whether ``cls`` and its bases (``object`` aside) are all classes written in Python: no C layout
    that C code could read from an object claiming to be one (see :mod:`bcg_diffusion.core.opaque`)."""
    heap = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement
    return all(base is object or base.__flags__ & heap for base in cls.__mro__) and not issubclass(
        cls, (torch.nn.Module, type)
    )


@functools.lru_cache(maxsize=256)
def _plain_class(cls: type) -> bool:
    callable_instances = any("__call__" in vars(base) for base in cls.__mro__)
    return cls.__new__ is object.__new__ and not issubclass(cls, (torch.nn.Module, type)) and not callable_instances


def _is_plain_object(value: Any) -> bool:
    """An instance of a plain Python class that only holds data in its ``__dict__`` (a KV cache such as
    diffusers' ``Flux2KVCache``): rebuilt by ``object.__new__`` and its attributes. Modules, callables,
    classes and instances of classes with a ``__new__`` or ``__slots__`` of their own are not."""
    return _plain_class(type(value)) and hasattr(value, "__dict__")


def _flatten(value: Any, leaves: list[torch.Tensor], opaque: list[Any] | None) -> Hashable:
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return (_TENSOR, tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad)
    if isinstance(value, _CONSTANT_TYPES):
        # type() in the key keeps 1, 1.0 and True apart: they hash equal but trace different code.
        return (_CONST, type(value), value)
    if isinstance(value, list):
        return (_LIST, tuple(_flatten(item, leaves, opaque) for item in value))
    if _is_output_dataclass(value):
        names = tuple(field.name for field in dataclasses.fields(value))
        return (_OUTPUT, type(value), names, tuple(_flatten(getattr(value, n), leaves, opaque) for n in names))
    if isinstance(value, tuple):
        kind = type(value) if type(value) is not tuple else None
        return (_TUPLE, kind, tuple(_flatten(item, leaves, opaque) for item in value))
    if isinstance(value, dict):
        keys = tuple(value.keys())
        return (_DICT, type(value), keys, tuple(_flatten(value[k], leaves, opaque) for k in keys))
    if _is_plain_object(value):
        attributes = vars(value)
        keys = tuple(attributes)
        mark = len(leaves), len(opaque) if opaque is not None else 0
        try:
            children = tuple(_flatten(attributes[k], leaves, opaque) for k in keys)
            return (_OBJECT, type(value), keys, children)
        except UnsupportedValue as exc:
            if opaque is None:
                where = f"{type(value).__qualname__}.{_failing_key(attributes, keys)}"
                raise UnsupportedValue(f"{exc} (in {where})") from None
            del leaves[mark[0] :], opaque[mark[1] :]  # set the whole object aside instead
    if opaque is not None and getattr(type(value), "bcg_stand_in", False):
        opaque.append(value)
        return (_OPAQUE, value.stands_for)  # a stand-in keeps its real object's class in the spec
    if opaque is not None and pure_python(type(value)):
        opaque.append(value)
        return (_OPAQUE, type(value))
    raise UnsupportedValue(
        f"cannot use a value of type {type(value).__module__}.{type(value).__qualname__} in a graph signature"
    )


def _failing_key(attributes: dict[str, Any], keys: tuple[str, ...]) -> str:
    for key in keys:
        try:
            _flatten(attributes[key], [], None)
        except UnsupportedValue:
            return key
    return "?"


def flatten(value: Any, opaque: list[Any] | None = None) -> tuple[list[torch.Tensor], Hashable]:
    """Split ``value`` into its tensors (in a fixed order) and a hashable spec of everything else.

    Supports tensors, ``None``, bools, ints, floats, strings, dtypes, devices, and lists, tuples
    (named tuples too), dicts and dataclasses (diffusers output classes) of those, and instances of
    plain Python classes whose attributes are all of those (KV caches: rebuilt as new instances of
    the same class with the same attributes; the class and attribute names join the spec).

    With ``opaque`` (a list), any other instance of a class written in Python (:func:`pure_python`)
    is appended to it and stands in the spec as its class (:mod:`bcg_diffusion.core.opaque` passes a
    stand-in for it); :func:`unflatten` then takes the objects to put back, in the same order.

    Raises:
        UnsupportedValue: for any other object (a generator, a module, a function...), and with
            ``opaque`` None for every object that is not made of the values above.
    """
    leaves: list[torch.Tensor] = []
    spec = _flatten(value, leaves, opaque)
    return leaves, spec


def _unflatten(spec: Any, leaves: list[Any], position: list[int], opaque: list[Any]) -> Any:
    tag = spec[0]
    if tag == _TENSOR:
        leaf = leaves[position[0]]
        position[0] += 1
        return leaf
    if tag == _CONST:
        return spec[2]
    if tag == _LIST:
        return [_unflatten(child, leaves, position, opaque) for child in spec[1]]
    if tag == _TUPLE:
        items = [_unflatten(child, leaves, position, opaque) for child in spec[2]]
        kind = spec[1]
        if kind is None:
            return tuple(items)
        return kind(*items) if hasattr(kind, "_fields") else kind(items)
    if tag == _DICT:
        kind, keys = spec[1], spec[2]
        return kind(zip(keys, (_unflatten(child, leaves, position, opaque) for child in spec[3])))
    if tag == _OUTPUT:
        kind, names = spec[1], spec[2]
        return kind(**{name: _unflatten(child, leaves, position, opaque) for name, child in zip(names, spec[3])})
    if tag == _OBJECT:
        kind, names = spec[1], spec[2]
        rebuilt = object.__new__(kind)
        vars(rebuilt).update(
            (name, _unflatten(child, leaves, position, opaque)) for name, child in zip(names, spec[3])
        )
        return rebuilt
    if tag == _OPAQUE:
        return opaque.pop(0)
    raise ValueError(f"corrupt spec node {tag!r}")


def unflatten(spec: Hashable, leaves: list[Any], opaque: list[Any] = ()) -> Any:
    """Rebuild a value of structure ``spec`` (from :func:`flatten`) around ``leaves``, in order, with
    ``opaque`` in the places of the values :func:`flatten` set aside."""
    position = [0]
    value = _unflatten(spec, leaves, position, list(opaque))
    if position[0] != len(leaves):
        raise ValueError(f"spec uses {position[0]} leaves but {len(leaves)} were given")
    return value


def describe(spec: Hashable, limit: int = 400) -> str:
    """A short human-readable rendering of a spec, for stats and warnings."""

    def render(node: Any) -> str:
        tag = node[0]
        if tag == _TENSOR:
            shape = "x".join(str(s) for s in node[1])
            return f"{str(node[3]).removeprefix('torch.')}[{shape}]"
        if tag == _CONST:
            return repr(node[2])
        if tag == _LIST:
            return "[" + ", ".join(render(c) for c in node[1]) + "]"
        if tag == _TUPLE:
            return "(" + ", ".join(render(c) for c in node[2]) + ")"
        if tag == _DICT:
            return "{" + ", ".join(f"{k}: {render(c)}" for k, c in zip(node[2], node[3])) + "}"
        if tag == _OPAQUE:
            return f"<{node[1].__qualname__}>"
        if tag in (_OUTPUT, _OBJECT):
            return node[1].__name__ + "(" + ", ".join(f"{n}={render(c)}" for n, c in zip(node[2], node[3])) + ")"
        return repr(node)

    text = render(spec)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _tensor_text(node: Any) -> str:
    return f"{str(node[3]).removeprefix('torch.')}[{'x'.join(str(s) for s in node[1])}] on {node[4]}"


def differences(old: Hashable, new: Hashable, path: str = "") -> list[str]:
    """Where two specs differ, as short ``path: old -> new`` lines (empty when equal).

    >>> import torch
    >>> a = flatten({"x": torch.zeros(1, 11)})[1]
    >>> b = flatten({"x": torch.zeros(1, 20)})[1]
    >>> differences(a, b)
    ['x: float32[1x11] on cpu -> float32[1x20] on cpu']
    """
    if old == new:
        return []
    label = path or "value"
    if old[0] != new[0]:
        return [f"{label}: {describe(old, 60)} -> {describe(new, 60)}"]
    tag = old[0]
    if tag == _TENSOR:
        if (old[1], old[3], old[4]) == (new[1], new[3], new[4]):
            if old[2] != new[2]:
                return [f"{label}: strides {old[2]} -> {new[2]}"]
            return [f"{label}: requires_grad {old[5]} -> {new[5]}"]
        return [f"{label}: {_tensor_text(old)} -> {_tensor_text(new)}"]
    if tag == _CONST:
        return [f"{label}: {old[2]!r} -> {new[2]!r}"]
    if tag == _OPAQUE:
        return [f"{label}: {describe(old, 60)} -> {describe(new, 60)}"]
    children_old, children_new, names = _children(old), _children(new), _child_names(old)
    if len(children_old) != len(children_new) or _child_names(new) != names:
        return [f"{label}: {describe(old, 60)} -> {describe(new, 60)}"]
    lines = []
    for name, child_old, child_new in zip(names, children_old, children_new):
        lines += differences(child_old, child_new, f"{path}.{name}" if path else str(name))
    return lines


def _children(node: Any) -> tuple:
    tag = node[0]
    if tag == _LIST:
        return node[1]
    if tag == _TUPLE:
        return node[2]
    return node[3]  # dict, output dataclass and object


def _child_names(node: Any) -> tuple:
    tag = node[0]
    if tag in (_LIST, _TUPLE):
        return tuple(str(i) for i in range(len(_children(node))))
    return tuple(str(k) for k in node[2])
