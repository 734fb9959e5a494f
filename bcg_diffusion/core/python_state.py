"""Python state a captured forward read, checked between calls so that a graph never replays a stale value.

A graph replays the kernels its forward launched at capture, with every Python value the forward read
then baked in: ``out + 0.05 * self.shift``, ``torch.tensor([self.shift], device=...)``, ``if
self.use_extra:``, the weight tensor ``self.proj.weight`` held at that moment. When a user (or the
model itself) changes such a value between calls, eager follows and a replay would not. This module
finds what a capture read and checks it once per pipeline call:

* :class:`ReadRecorder` notes, during one eager warm-up, every attribute of the component's modules
  that the forward reads: plain instance attributes (numbers, strings, ``None``, tuples, lists and
  dicts of those) by value; parameters, buffers, submodules and tensors in plain attributes (by identity
  and storage), containers holding tensors or objects (their items, by identity), NumPy arrays (by
  content); any other object (an attention processor, a function) by identity, and an object's own
  attributes as plain attributes are watched; names read but absent (``getattr(self, "extra", None)``);
  and, for every module the forward calls, its forward hooks and pre-hooks (added or removed) and an
  instance ``forward`` (set, replaced or deleted). It installs ``__getattribute__`` on ``torch.nn.Module``
  for the run's duration (one Python call per attribute read, paid in that warm-up only). Compiled
  regions cannot run under it (dynamo traces attribute access itself), so they run with the hook
  taken off (:func:`paused`), and the recorder then asks for one more run in which compiled code
  runs its eager original (:func:`through_compiled`). An attribute the forward writes itself is the
  forward's own (a VAE's per-call feature cache, a flag set at the first call), not watched.
* :class:`StateWatch` (one per runner) keeps what each captured signature read and, at each check,
  compares the current values with the captured ones: identical objects for immutable values, equal
  plain values for containers, the same tensor object with the same storage for parameters. A change
  names the attribute (``layers.0.shift: 1.0 -> 5.0``) and the signatures that read it, which the
  runner drops and captures again.
* :func:`call_scope` marks one pipeline call: a runner checks at its first call inside a scope and
  not again in it (a 50-step call checks once, not 50 times); outside any scope (a component called
  directly) it checks at every call.

What it cannot see: module globals and closures a forward reads, class attributes, attributes two
levels into a non-module object (``processor.config.scale``), values a forward reads through
``__dict__`` directly, and changes made between the steps of one pipeline call. ``invalidate(pipe)``
drops the graphs after such a change; ``docs/invalidation.md`` lists them. Global torch settings
(autocast, TF32, SDP backends...) are not watched here: they key each signature
(:mod:`bcg_diffusion.core.settings`).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import itertools
import operator
import threading
import types
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.hooks

__all__ = [
    "ReadRecorder",
    "StateWatch",
    "Watched",
    "call_scope",
    "current_scope",
    "note_data",
    "paused",
    "plain",
    "recording",
    "through_compiled",
]

_SKIP = object()
ABSENT = object()  # the value of a name read but not set: a later assignment is a change
_VOLATILE = object()  # the token of a value the forward changes itself at every run: it never matches

# Bookkeeping of nn.Module itself, read by every call (hooks, registries): not values a forward computes with.
_MODULE_INTERNALS = frozenset(
    {
        "__dict__",
        "__class__",
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_backward_pre_hooks",
        "_backward_hooks",
        "_is_full_backward_hook",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks_with_kwargs",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_compiled_call_impl",
        # hook registries (accelerate's, diffusers'): the runner follows those itself
        "_hf_hook",
        "_diffusers_hook",
    }
)
_IMMUTABLE = (type(None), bool, int, float, str, bytes, complex, torch.dtype, torch.device)
# What nn.Module.__call__ reads of every module it runs: watched by size and last handle id (handle ids only
# grow, so the pair changes whenever a hook is added or removed).
_HOOK_REGISTRIES = frozenset({"_forward_hooks", "_forward_pre_hooks"})
# Objects whose own attributes are not looked into (watched by identity alone).
_OPAQUE = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.ModuleType, enum.Enum)


def plain(value: Any) -> Any:
    """``value`` as something comparable that a graph could have baked in: Python scalars and strings as
    they are, tensors by storage address and layout, tuples, lists and dicts of those item by item;
    ``_SKIP`` (a private marker) for anything else (objects, functions)."""
    if value is None or isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", storage(value), tuple(value.shape), value.stride(), value.dtype, value.device)
    if isinstance(value, (tuple, list)):
        items = tuple(plain(item) for item in value)
        return _SKIP if any(item is _SKIP for item in items) else (type(value).__name__, items)
    if isinstance(value, dict):
        items = tuple((repr(key), plain(item)) for key, item in value.items())
        return _SKIP if any(item is _SKIP for _, item in items) else ("dict", tuple(sorted(items, key=repr)))
    return _SKIP


def storage(tensor: torch.Tensor) -> Any:
    """Where ``tensor``'s values live, as something comparable with ``==``: a plain tensor's data address;
    for a wrapper subclass (a tensor with ``__tensor_flatten__``, such as torchao's ``Float8Tensor``), which
    has no storage of its own (its ``data_ptr()`` is 0, and slow through its ``__torch_function__``), a
    tuple of ``(name, storage)`` for each inner tensor that holds its values. A graph reads those inner
    tensors' memory, so assigning one (``weight.qdata = other``) is a change."""
    if getattr(type(tensor), "__tensor_flatten__", None) is None:
        return tensor.data_ptr()
    names, _ = tensor.__tensor_flatten__()
    return tuple((name, storage(getattr(tensor, name))) for name in names)


def is_skipped(token: Any) -> bool:
    """Whether :func:`plain` found nothing comparable in a value."""
    return token is _SKIP


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_tensor(item) for item in value.values())
    return False


def _hooks_token(registry: dict) -> Any:
    return (len(registry), next(reversed(registry))) if registry else 0


def _keys_token(attributes: dict) -> Any:
    return (len(attributes), tuple(attributes))


def _array_token(value: Any) -> Any:
    return ("ndarray", value.dtype.str, value.shape, value.tobytes())


def _is_array(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


def _items(value: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """A container's keys (None for a list or tuple) and its items, compared by identity."""
    return (tuple(value), tuple(value.values())) if isinstance(value, dict) else (None, tuple(value))


@dataclass(eq=False)
class Watched:
    """One value a capture read: where it lives (``holder[name]``, or ``data`` itself for the Python data
    of a graph constant), the object read and its comparable form.

    Kinds: ``attribute`` (a plain value, compared by :func:`plain`), ``tensor`` (a parameter, buffer or
    tensor attribute: the same object on the same storage), ``module`` and ``object`` (the same object),
    ``items`` (a container holding tensors or objects: the same keys, each bound to the same object),
    ``array`` (a NumPy array: the same dtype, shape and bytes), ``binding`` (an instance ``forward``: the
    same function, or still absent), ``hooks`` (a hook registry: no hook added or removed), ``names`` (an
    object's attribute names: none added or removed), ``absent`` (still not set) and ``data`` (a graph
    constant's Python data, compared by :func:`plain`). A value the forward changes itself at every run is
    volatile: it never compares equal, so its signatures capture again at every call."""

    ident: tuple[int, str]  # (id of the module, object or data, name): one item per value watched
    where: str  # for messages: "layers.0.shift", "layers.0.proj.weight"...
    kind: str
    holder: Any  # the dict the name lives in (a module's __dict__, _parameters, _buffers, _modules); a registry
    name: str
    value: Any
    token: Any
    shown: str = ""  # the value as read, for messages (a container may change in place later)

    def current(self) -> Any:
        """The value now (``ABSENT`` when unset)."""
        if self.kind in ("data", "hooks", "names"):
            return self.value
        if self.kind == "absent":
            for holder in self.holder:
                if self.name in holder:
                    return holder[self.name]
            return ABSENT
        if self.kind == "binding":
            return own_forward(self.holder)
        return self.holder.get(self.name, ABSENT)

    def changed(self) -> bool:
        """Whether the value now differs from the one read at capture."""
        if self.token is _VOLATILE:
            return True
        value = self.current()
        kind = self.kind
        if kind == "attribute":
            if value is self.value and isinstance(value, _IMMUTABLE):
                return False
            return value is ABSENT or plain(value) != self.token
        if kind == "tensor":  # the same tensor object, on the same storage (or None, as before)
            return value is not self.value or (value is not None and storage(value) != self.token)
        if kind in ("module", "object", "binding"):
            return value is not self.value
        if kind == "absent":
            return value is not ABSENT
        if kind == "hooks":
            return _hooks_token(value) != self.token
        if kind == "names":
            return _keys_token(value) != self.token
        if kind == "array":
            return not _is_array(value) or _array_token(value) != self.token
        if kind == "items":
            keys, values = self.token
            if type(value) is not type(self.value) or len(value) != len(values):
                return True
            if isinstance(value, dict):
                return tuple(value) != keys or not all(map(operator.is_, value.values(), values))
            return not all(map(operator.is_, value, values))
        return plain(value) != self.token  # data

    def refresh(self) -> None:
        """Take the value as it is now as the one read (the forward may have initialised it lazily after
        reading it, which its later runs, the capture's among them, see done)."""
        kind = self.kind
        if kind in ("data", "hooks", "names", "absent"):
            if kind == "hooks":
                self.token = _hooks_token(self.value)
            elif kind == "names":
                self.token = _keys_token(self.value)
            elif kind == "data":
                self.token, self.shown = plain(self.value), _short(self.value)
            return
        if kind == "binding":
            self.value = own_forward(self.holder)
            return
        value = self.holder.get(self.name, ABSENT)
        if value is ABSENT:
            self.token = _VOLATILE
            return
        if kind == "tensor":
            self.value, self.token = value, storage(value) if value is not None else None
            return
        [fresh, *_] = watch_value(self.ident, self.where, self.holder, self.name, value, depth=0)
        if fresh.kind != kind and not (kind == "object" and fresh.kind == "object"):
            self.token = _VOLATILE  # it is another kind of value now: the forward rebinds it
            return
        self.value, self.token, self.shown = fresh.value, fresh.token, fresh.shown

    def describe_change(self) -> str:
        if self.token is _VOLATILE:
            return f"{self.where}: changed by the forward itself during the capture's runs"
        value = self.current()
        before = self.shown or _short(self.value)
        if self.kind in ("attribute", "array", "items", "object", "binding"):
            return f"{self.where}: {before} -> {_short(value)}"
        if self.kind == "absent":
            return f"{self.where}: unset -> {_short(value)}"
        if self.kind == "hooks":
            return f"{self.where}: hooks added or removed ({before} -> {len(value)})"
        if self.kind == "names":
            added = sorted(set(value) - set(self.token[1]))
            removed = sorted(set(self.token[1]) - set(value))
            return f"{self.where}: attributes added {added}, removed {removed}"
        if self.kind == "data":
            return f"{self.where}: {before} -> {_short(plain_copy(value))} (changed in place)"
        return f"{self.where}: replaced"


def own_forward(instance: dict) -> Any:
    """The ``forward`` a module's ``__dict__`` sets on the instance (``ABSENT``: none), except the wrappers of
    diffusers' hook registry (``_diffusers_hook``), and the class's own forward bound to the module, which it
    leaves when its hooks go: the step caches carry those hooks through the graphs and key the signatures on
    them, and enabling or disabling a cache must not drop the other hooks' graphs."""
    value = instance.get("forward", ABSENT)
    if value is ABSENT:
        return value
    if "_diffusers_hook" in instance and isinstance(value, functools.partial):
        return ABSENT
    # The class's own forward bound to the module (what diffusers puts back when its last hook goes) is no
    # forward of the instance's own.
    owner = getattr(value, "__self__", None)
    if (
        isinstance(value, types.MethodType)
        and getattr(owner, "__dict__", None) is instance
        and value.__func__ is getattr(type(owner), "forward", None)
    ):
        return ABSENT
    return value


def plain_copy(value: Any) -> Any:
    """``value`` itself, or for a list or dict a shallow copy (for messages that show it as it was)."""
    return list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else value


def watch_value(
    ident: tuple[int, str], where: str, holder: dict, name: str, value: Any, depth: int = 1
) -> list[Watched]:
    """The :class:`Watched` items for ``holder[name]`` (``value``), read at ``where``: one, plus for an object
    (not a function, class or enum) with a ``__dict__``, its own attributes, ``depth`` levels down."""
    if isinstance(value, torch.Tensor):
        return [Watched(ident, where, "tensor", holder, name, value, storage(value))]
    if isinstance(value, torch.nn.Module):
        return [Watched(ident, where, "module", holder, name, value, None)]
    if _is_array(value):
        return [Watched(ident, where, "array", holder, name, value, _array_token(value), _short(value.tolist()))]
    token = plain(value)
    if token is not _SKIP:
        shown = _short(value) if isinstance(value, (list, dict)) else ""
        return [Watched(ident, where, "attribute", holder, name, value, token, shown)]
    if isinstance(value, (list, tuple, dict)):
        return [Watched(ident, where, "items", holder, name, value, _items(value), _short(value))]
    found = [Watched(ident, where, "object", holder, name, value, None, f"<{type(value).__qualname__}>")]
    if depth > 0:
        found += object_attributes(where, value)
    return found


def object_attributes(where: str, value: Any) -> list[Watched]:
    """The :class:`Watched` items of an object's own attributes (not a function's, class's or enum's), each
    one level deep, and of the set of their names (an attribute added later is a change)."""
    attributes = getattr(value, "__dict__", None)
    if not isinstance(attributes, dict) or isinstance(value, _OPAQUE):
        return []
    ident = (id(value), "<attributes>")
    found = [Watched(ident, where, "names", attributes, "", attributes, _keys_token(attributes))]
    for attribute, item in list(attributes.items()):
        found += watch_value((id(value), attribute), f"{where}.{attribute}", attributes, attribute, item, depth=0)
    return found


def _short(value: Any) -> str:
    if value is ABSENT:
        return "deleted"
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')}[{'x'.join(map(str, value.shape))}]"
    if not isinstance(value, (*_IMMUTABLE, list, tuple, dict)) and not _is_array(value):
        return f"<{type(value).__qualname__} object>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------- recording

_OBJECT_GETATTRIBUTE = object.__getattribute__
_MODULE_SETATTR = torch.nn.Module.__setattr__
_RECORDERS: list[ReadRecorder] = []  # active, innermost last
_INSTALLED = [False]


def _recording_getattribute(self: Any, name: str) -> Any:
    try:
        value = _OBJECT_GETATTRIBUTE(self, name)
    except AttributeError:
        if _RECORDERS:
            _RECORDERS[-1].note_missing(self, name)
        raise
    if _RECORDERS and name not in _MODULE_INTERNALS:
        _RECORDERS[-1].note_read(self, name, value)
    return value


def _recording_setattr(self: Any, name: str, value: Any) -> None:
    if _RECORDERS:
        _RECORDERS[-1].note_write(self, name)
    _MODULE_SETATTR(self, name, value)


def _install() -> None:
    if not _INSTALLED[0]:
        torch.nn.Module.__getattribute__ = _recording_getattribute  # type: ignore[method-assign]
        torch.nn.Module.__setattr__ = _recording_setattr  # type: ignore[method-assign]
        _INSTALLED[0] = True


def _uninstall() -> None:
    if _INSTALLED[0]:
        del torch.nn.Module.__getattribute__
        torch.nn.Module.__setattr__ = _MODULE_SETATTR  # type: ignore[method-assign]
        _INSTALLED[0] = False


@contextlib.contextmanager
def paused() -> Iterator[bool]:
    """Take the recording hook off ``torch.nn.Module`` for the block (compiled code runs inside: dynamo
    traces attribute access itself, and would refuse a class with a ``__getattribute__`` of ours).
    Yields whether a recorder was active; it counts the region in :attr:`ReadRecorder.paused`."""
    if not _INSTALLED[0]:
        yield False
        return
    recorder = _RECORDERS[-1]
    recorder.paused += 1
    _uninstall()
    try:
        yield True
    finally:
        _install()


def recording() -> bool:
    """Whether a :class:`ReadRecorder`'s hook is on ``torch.nn.Module`` now (one list read)."""
    return _INSTALLED[0]


def note_data(where: str, data: Any) -> None:
    """Hand the innermost active recorder the Python data a graph constant was built from
    (:meth:`ReadRecorder.add_data`); nothing when none is recording."""
    if _INSTALLED[0] and _RECORDERS:
        _RECORDERS[-1].add_data(where, data)


def through_compiled() -> bool:
    """Whether compiled regions should run their eager originals now, so a recorder sees their reads."""
    return bool(_RECORDERS) and _RECORDERS[-1].through_compiled and _INSTALLED[0]


class ReadRecorder:
    """Notes the attributes of ``modules`` that the code run under :meth:`recording` reads.

    ``modules`` maps ``id(module)`` to ``(path, module)`` (paths name attributes in messages). After a
    recording, :attr:`reads` holds one :class:`Watched` per attribute read (its first read), except the
    attributes the run writes itself: those are the forward's own state (a lazily set flag, a per-call
    cache), which it sets whatever the value before. :attr:`paused`
    counts the compiled regions run without the hook; when it is not zero, run once more under
    ``recording(through_compiled=True)`` to see inside them.

    Example::

        recorder = ReadRecorder({id(m): (name, m) for name, m in model.named_modules()})
        with recorder.recording():
            model(x)
        [w.where for w in recorder.reads.values()]   # ["proj.weight", "proj.bias", "shift", ...]
    """

    def __init__(self, modules: dict[int, tuple[str, torch.nn.Module]], skip: set[int] = frozenset()) -> None:
        self.modules = modules
        self.skip = skip  # ids of objects that something else carries through the graphs: not watched
        self.reads: dict[tuple[int, str], Watched] = {}
        self.written: set[tuple[int, str]] = set()
        self.paused = 0
        self.through_compiled = False
        self._thread = threading.get_ident()
        self._refreshed: set[tuple[int, str]] = set()

    @contextlib.contextmanager
    def recording(self, through_compiled: bool = False) -> Iterator[ReadRecorder]:
        """Note what the code run inside reads. When the run ends, every value is taken as it is then (see
        :meth:`Watched.refresh`), and the attributes of every object read are added as they are then."""
        self.through_compiled, self.paused = through_compiled, 0
        self._thread = threading.get_ident()
        _RECORDERS.append(self)
        _install()
        try:
            yield self
        finally:
            _RECORDERS.remove(self)
            if not _RECORDERS:
                _uninstall()
            self.through_compiled = False
            self._after_run()

    def _after_run(self) -> None:
        for item in list(self.reads.values()):
            if item.ident in self._refreshed:
                continue
            self._refreshed.add(item.ident)
            item.refresh()
            if item.kind == "object" and item.token is not _VOLATILE:
                for child in object_attributes(item.where, item.value):
                    if child.ident not in self.reads:
                        self.reads[child.ident] = child
                        self._refreshed.add(child.ident)

    def settle(self) -> None:
        """After the capture: a value that changed since the end of the first run was changed by the forward
        itself in a later run (the capture's among them), so what the graph read is not known: volatile."""
        for item in self.reads.values():
            if item.token is not _VOLATILE and item.changed():
                item.token = _VOLATILE

    def add_data(self, where: str, data: Any) -> None:
        """Watch ``data``, the Python data a graph constant was built from (a module-level list changed
        in place later changes the constant), when it is a mutable container of plain values or a NumPy
        array (``torch.as_tensor(self.table)``)."""
        ident = (id(data), "<data>")
        if _is_array(data):
            self.reads.setdefault(ident, Watched(ident, where, "array", {"": data}, "", data, _array_token(data)))
        elif isinstance(data, (list, dict)) and not _holds_tensor(data):
            token = plain(data)
            if token is not _SKIP:
                self.reads.setdefault(ident, Watched(ident, where, "data", None, "", data, token, _short(data)))

    # The three notes run inside every attribute access of the recording run: keep them lean.
    def note_read(self, module: Any, name: str, value: Any) -> None:
        entry = self.modules.get(id(module))
        if entry is None or threading.get_ident() != self._thread:
            return
        key = (id(module), name)
        if key in self.reads or key in self.written:
            return
        instance = _OBJECT_GETATTRIBUTE(module, "__dict__")
        where = _join(entry[0], name)
        if name == "forward":  # read by nn.Module.__call__: a forward set on the instance replaces the class's
            self.reads[key] = Watched(key, where, "binding", instance, name, own_forward(instance), None)
            return
        if name in _HOOK_REGISTRIES:
            self.reads[key] = Watched(key, where, "hooks", value, name, value, _hooks_token(value), str(len(value)))
            return
        if instance.get(name, ABSENT) is not value or id(value) in self.skip:
            return  # a class attribute, method or property: not instance state; or a value carried by others
        for item in watch_value(key, where, instance, name, value):
            self.reads.setdefault(item.ident, item)

    def note_missing(self, module: Any, name: str) -> None:
        entry = self.modules.get(id(module))
        if entry is None or threading.get_ident() != self._thread:
            return
        if name.startswith("__") or name in _MODULE_INTERNALS:
            return
        key = (id(module), name)
        if key in self.reads or key in self.written:
            return
        instance = _OBJECT_GETATTRIBUTE(module, "__dict__")
        where = _join(entry[0], name)
        for registry, kind in (("_parameters", "tensor"), ("_buffers", "tensor"), ("_modules", "module")):
            holder = instance.get(registry)
            if holder is not None and name in holder:
                value = holder[name]
                if kind == "tensor":
                    token = storage(value) if value is not None else None
                    self.reads[key] = Watched(key, where, kind, holder, name, value, token)
                else:
                    self.reads[key] = Watched(key, where, kind, holder, name, value, None)
                return
        holders = tuple(
            h for h in (instance, *(instance.get(r) for r in ("_parameters", "_buffers", "_modules"))) if h
        )
        self.reads[key] = Watched(key, where, "absent", holders, name, ABSENT, None)

    def note_write(self, module: Any, name: str) -> None:
        if id(module) in self.modules and threading.get_ident() == self._thread:
            key = (id(module), name)
            self.written.add(key)
            self.reads.pop(key, None)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# ---------------------------------------------------------------------------------------------- checking


class StateWatch:
    """What each captured signature of one runner read (:class:`Watched` items), checked on demand.

    :meth:`changes` runs at every pipeline call, over thousands of items on a 60-block model, so it
    first asks one cheap question of all of them at once (is every name still bound to the very object
    read, every tensor on its storage?) and looks closer only when that fails or for the few values
    that can change in place (lists, dicts).
    """

    def __init__(self) -> None:
        self._items: dict[tuple[int, str], Watched] = {}
        self._readers: dict[tuple[int, str], set[Hashable]] = {}
        self._compiled: tuple[list, ...] | None = None
        self._hook_mark: int | None = None  # the hook counter when every registry last held its capture hooks
        self._held_hooks: list[Watched] = []  # the registries that held hooks at capture

    def __len__(self) -> int:
        return len(self._items)

    def add(self, key: Hashable, reads: dict[tuple[int, str], Watched]) -> list[Watched]:
        """Note that signature ``key`` read ``reads``. Returns the items other signatures read with
        another value (changed since they were captured): drop their readers."""
        stale = []
        for ident, item in reads.items():
            known = self._items.get(ident)
            if known is not None and known.changed():
                stale.append(known)
                continue
            if known is None:
                self._items[ident] = item
                self._compiled = None
            self._readers.setdefault(ident, set()).add(key)
        return stale

    def changes(self) -> list[Watched]:
        """The watched values that changed since their capture."""
        if self._compiled is None:
            self._compiled = self._compile()
        holders, names, values, tensors, pointers, registries, sizes, empty_hooks, by_value = self._compiled
        unchanged = (
            all(map(operator.is_, map(dict.get, holders, names, itertools.repeat(ABSENT)), values))
            and list(map(torch.Tensor.data_ptr, tensors)) == pointers
            and list(map(len, registries)) == sizes
            and self._no_hook_added(empty_hooks)
            and not any(item.changed() for item in by_value)
        )
        if unchanged:
            return []
        changed = [item for item in self._items.values() if item.changed()]
        if not changed:
            # Nothing changed by each value's own test (an equal float rebound, a diffusers hook wrapper set on
            # a block): the state as it is now is the one the fast pass compares with from here on.
            self._compiled = self._compile(current=True)
        return changed

    def _no_hook_added(self, empty: list[dict]) -> bool:
        """Whether every hook registry holds the hooks it held at capture. Those that held some are compared by
        size and last handle id; the (thousands of) empty ones can only have gained hooks, and every hook torch
        registers takes the next id of one process-wide counter: while it stands where it stood at the last look
        that found them all empty, they are, and the look costs one comparison."""
        if any(item.changed() for item in self._held_hooks):
            return False
        mark = _next_hook_id()
        if mark is not None and mark == self._hook_mark:
            return True
        if any(map(len, empty)):
            return False
        self._hook_mark = mark
        return True

    def _compile(self, current: bool = False) -> tuple[list, ...]:
        """The lists :meth:`changes` checks in one pass: (holder, name, object read) for every value bound by
        name (``None`` and an absent instance ``forward`` included), (tensor, data address) for every plain
        tensor, the size of every hook registry, and the items compared by value (registries that held hooks,
        containers, arrays). A wrapper subclass's inner tensors (:func:`storage`) are bound by name in its
        ``__dict__`` and checked the same way; those it keeps elsewhere are compared by value. With ``current``,
        the names are bound to what they hold now (after a full look found nothing changed)."""
        holders, names, values, tensors, pointers, registries, sizes, by_value = [], [], [], [], [], [], [], []
        empty_hooks: list[dict] = []
        self._hook_mark, self._held_hooks = None, []
        for item in self._items.values():
            kind = item.kind
            if item.token is _VOLATILE:
                by_value.append(item)
                continue
            if kind == "hooks":
                (empty_hooks if item.token == 0 else self._held_hooks).append(item.holder if item.token == 0 else item)
                continue
            if kind == "names":
                registries.append(item.holder)
                sizes.append(item.token[0])
                continue
            single = kind in ("attribute", "tensor", "module", "object", "binding", "items", "array")
            if single:
                holders.append(item.holder)
                names.append(item.name)
                values.append(item.holder.get(item.name, ABSENT) if current else item.value)
            if (
                kind == "tensor"
                and item.value is not None
                and not _bind_storage(item.value, item.token, holders, names, values, tensors, pointers)
            ):
                by_value.append(item)
            if not single or kind in ("items", "array") or (kind == "attribute" and not _immutable(item.value)):
                by_value.append(item)
        return holders, names, values, tensors, pointers, registries, sizes, empty_hooks, by_value

    def readers(self, item: Watched) -> set[Hashable]:
        """The signatures that read ``item``."""
        return set(self._readers.get(item.ident, ()))

    def forget_item(self, item: Watched) -> None:
        self._items.pop(item.ident, None)
        self._readers.pop(item.ident, None)
        self._compiled = None

    def forget(self, key: Hashable) -> None:
        """Signature ``key`` is gone: stop watching what only it read."""
        for ident in [i for i, keys in self._readers.items() if key in keys]:
            keys = self._readers[ident]
            keys.discard(key)
            if not keys:
                del self._readers[ident]
                self._items.pop(ident, None)
                self._compiled = None

    def clear(self) -> None:
        self._items.clear()
        self._readers.clear()
        self._compiled = None


def _next_hook_id() -> int | None:
    """The id torch's next hook handle will take (None where torch keeps no such counter)."""
    return getattr(torch.utils.hooks.RemovableHandle, "next_id", None)


def _bind_storage(
    tensor: torch.Tensor, token: Any, holders: list, names: list, values: list, tensors: list, pointers: list
) -> bool:
    """Add ``tensor``'s storage (:func:`storage` gave ``token`` at capture) to :meth:`StateWatch._compile`'s
    lists: a plain tensor's address, or a wrapper subclass's inner tensors, each bound by name in its
    ``__dict__`` and checked the same way. False where that cannot be done (an inner tensor that is not an
    instance attribute, or not there at all); the caller then compares the tensor by value."""
    if not isinstance(token, tuple):
        tensors.append(tensor)
        pointers.append(token)
        return True
    instance = getattr(tensor, "__dict__", {})
    for name, inner_token in token:
        inner = instance.get(name, ABSENT)
        if not isinstance(inner, torch.Tensor):
            return False
        holders.append(instance)
        names.append(name)
        values.append(inner)
        if not _bind_storage(inner, inner_token, holders, names, values, tensors, pointers):
            return False
    return True


def _immutable(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_immutable(item) for item in value)
    return isinstance(value, _IMMUTABLE)


# ------------------------------------------------------------------------------------------- call scopes

_SCOPE: contextvars.ContextVar[tuple[int, Any] | None] = contextvars.ContextVar("bcg_call_scope", default=None)
_SCOPE_IDS = itertools.count(1)


@contextlib.contextmanager
def call_scope(value: Any = None) -> Iterator[int]:
    """One pipeline call: runners check their watched state at their first call inside and not again.
    ``value`` is whatever the caller wants :func:`current_scope` to return meanwhile. Yields the
    scope's number."""
    number = next(_SCOPE_IDS)
    token = _SCOPE.set((number, value))
    try:
        yield number
    finally:
        _SCOPE.reset(token)


def current_scope() -> tuple[int, Any] | None:
    """``(number, value)`` of the innermost :func:`call_scope`, or None outside one."""
    return _SCOPE.get()
