"""Python state a captured forward read, checked between calls so that a graph never replays a stale value.

A graph replays the kernels its forward launched at capture, with every Python value the forward read
then baked in: ``out + 0.05 * self.shift``, ``torch.tensor([self.shift], device=...)``, ``if
self.use_extra:``, the weight tensor ``self.proj.weight`` held at that moment. When a user (or the
model itself) changes such a value between calls, eager follows and a replay would not. This module
finds what a capture read and checks it once per pipeline call:

* :class:`ReadRecorder` notes, during one eager warm-up, every attribute of the component's modules
  that the forward reads: plain instance attributes (numbers, strings, ``None``, tuples, lists and
  dicts of those), parameters, buffers and submodules (by identity and storage), and names read but
  absent (``getattr(self, "extra", None)``). It installs ``__getattribute__`` on ``torch.nn.Module``
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

What it cannot see: module globals and closures a forward reads, class attributes, attributes of
objects that are not modules (attention processors), values a forward reads through ``__dict__``
directly, and changes made between the steps of one pipeline call. ``invalidate(pipe)`` drops the
graphs after such a change; ``docs/limits.md`` lists them.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import operator
import threading
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

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
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_compiled_call_impl",
        "forward",
        # hook registries (accelerate's, diffusers'): the runner follows those itself
        "_hf_hook",
        "_diffusers_hook",
    }
)
_IMMUTABLE = (type(None), bool, int, float, str)


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


@dataclass(eq=False)
class Watched:
    """One value a capture read: where it lives (``holder[name]``, or ``data`` itself for the Python data
    of a graph constant), the object read and its comparable form."""

    ident: tuple[int, str]  # (id of the module or data, name): one item per value watched
    where: str  # for messages: "layers.0.shift", "layers.0.proj.weight"...
    kind: str  # "attribute", "tensor", "module", "absent" or "data"
    holder: Any  # the dict the name lives in (a module's __dict__, _parameters, _buffers, _modules)
    name: str
    value: Any
    token: Any

    def current(self) -> Any:
        """The value now (``ABSENT`` when unset)."""
        if self.kind == "data":
            return self.value
        if self.kind == "absent":
            for holder in self.holder:
                if self.name in holder:
                    return holder[self.name]
            return ABSENT
        return self.holder.get(self.name, ABSENT)

    def changed(self) -> bool:
        """Whether the value now differs from the one read at capture."""
        value = self.current()
        if self.kind == "attribute":
            if value is self.value and isinstance(value, _IMMUTABLE):
                return False
            return value is ABSENT or plain(value) != self.token
        if self.kind == "tensor":  # the same parameter object, on the same storage (or None, as before)
            return value is not self.value or (value is not None and storage(value) != self.token)
        if self.kind == "module":
            return value is not self.value
        if self.kind == "absent":
            return value is not ABSENT
        return plain(value) != self.token  # data

    def describe_change(self) -> str:
        value = self.current()
        if self.kind == "attribute":
            return f"{self.where}: {_short(self.value)} -> {_short(value)}"
        if self.kind == "absent":
            return f"{self.where}: unset -> {_short(value)}"
        if self.kind == "data":
            return f"{self.where}: changed in place"
        return f"{self.where}: replaced"


def _short(value: Any) -> str:
    if value is ABSENT:
        return "deleted"
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

    def __init__(self, modules: dict[int, tuple[str, torch.nn.Module]]) -> None:
        self.modules = modules
        self.reads: dict[tuple[int, str], Watched] = {}
        self.written: set[tuple[int, str]] = set()
        self.paused = 0
        self.through_compiled = False
        self._thread = threading.get_ident()

    @contextlib.contextmanager
    def recording(self, through_compiled: bool = False) -> Iterator[ReadRecorder]:
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

    def add_data(self, where: str, data: Any) -> None:
        """Watch ``data``, the Python data a graph constant was built from (a module-level list changed
        in place later changes the constant), when it is a mutable container of plain values."""
        if isinstance(data, (list, dict)) and not _holds_tensor(data):
            token = plain(data)
            if token is not _SKIP:
                self.reads.setdefault(
                    (id(data), "<data>"), Watched((id(data), "<data>"), where, "data", None, "", data, token)
                )

    # The three notes run inside every attribute access of the recording run: keep them lean.
    def note_read(self, module: Any, name: str, value: Any) -> None:
        entry = self.modules.get(id(module))
        if entry is None or threading.get_ident() != self._thread:
            return
        key = (id(module), name)
        if key in self.reads or key in self.written:
            return
        instance = _OBJECT_GETATTRIBUTE(module, "__dict__")
        if instance.get(name, ABSENT) is not value:
            return  # a class attribute, method or property: not instance state
        if _holds_tensor(value):
            return  # an unregistered tensor is a cache the model manages (a RoPE table); not watched
        token = plain(value)
        if token is not _SKIP:
            self.reads[key] = Watched(key, _join(entry[0], name), "attribute", instance, name, value, token)

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
        self._compiled: tuple[list, list, list, list, list, list] | None = None

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
        holders, names, values, tensors, pointers, by_value = self._compiled
        unchanged = (
            all(map(operator.is_, map(dict.get, holders, names, itertools.repeat(ABSENT)), values))
            and list(map(torch.Tensor.data_ptr, tensors)) == pointers
            and not any(item.changed() for item in by_value)
        )
        return [] if unchanged else [item for item in self._items.values() if item.changed()]

    def _compile(self) -> tuple[list, list, list, list, list, list]:
        """The lists :meth:`changes` checks in one pass: (holder, name, object read) for every value
        bound by name (``None`` included), (tensor, data address) for every plain tensor, and the items
        compared by value. A wrapper subclass's inner tensors (:func:`storage`) are bound by name in its
        ``__dict__`` and checked the same way; those it keeps elsewhere are compared by value."""
        holders, names, values, tensors, pointers, by_value = [], [], [], [], [], []
        for item in self._items.values():
            single = item.kind in ("attribute", "tensor", "module")
            if single:
                holders.append(item.holder)
                names.append(item.name)
                values.append(item.value)
            if (
                item.kind == "tensor"
                and item.value is not None
                and not _bind_storage(item.value, item.token, holders, names, values, tensors, pointers)
            ):
                by_value.append(item)
            if not single or (item.kind == "attribute" and not _immutable(item.value)):
                by_value.append(item)
        return holders, names, values, tensors, pointers, by_value

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
