"""Finding what a CUDA graph capture cannot hold, with PyTorch's own dispatch machinery.

:class:`HostileOpFinder` is a dispatch mode that watches one eager run and notes every operation a
capture could not hold, outside the eager breaks that already handle it:

* **host syncs**: ``.item()``, ``int(t)``, ``if t:`` (``aten._local_scalar_dense``, ``aten.is_nonzero``),
  ``torch.equal``, copies from the GPU to the host (``.cpu()``, ``.tolist()``);
* **data-dependent shapes**: ``nonzero``, ``masked_select``, ``unique``, boolean indexing;
* **tensors built from Python data** (``torch.tensor([...])``: ``aten.lift_fresh``): their values
  come from Python, which a replay does not run, so a graph would keep the first call's values;
* **copies from host memory** that is not pinned (a capture refuses them);
* **collectives** (``torch.distributed``).

Each is recorded once as a :class:`HostileOp` with the operation, the path of the innermost module
running it (``transformer_blocks.3.attn``) and the first source line outside PyTorch. Ops are
classified by what they do on a GPU, so a CPU run finds them too: that is how debug mode reports, per
signature, what a capture would trip on (``stats()["signatures"][i]["hostile_ops"]``).

>>> with HostileOpFinder() as finder:                   # doctest: +SKIP
...     model(x)
>>> finder.found                                          # doctest: +SKIP
[HostileOp(op='aten._local_scalar_dense.default', kind='host sync', module='blocks.0', where='model.py:42 in forward')]
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import graphs

__all__ = ["HostileOp", "HostileOpFinder", "classify", "innermost_module", "user_frame"]

_SYNCS = {"_local_scalar_dense", "is_nonzero", "equal", "allclose"}
_DYNAMIC = {"nonzero", "masked_select", "unique_dim", "_unique", "_unique2", "unique_consecutive", "bincount"}
_FROM_PYTHON = {"lift_fresh", "lift_fresh_copy"}
_COPIES = {"copy_", "_to_copy", "_copy_from"}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional"}
_TORCH_DIR = os.path.dirname(torch.__file__)
_OUR_DIR = os.path.dirname(__file__)


@dataclass(frozen=True)
class HostileOp:
    """One operation a capture could not hold: what, of which kind, in which module, from which line."""

    op: str
    kind: str
    module: str
    where: str
    on_gpu: bool = False  # for "tensor from Python data": built on the GPU directly (its copy is not dispatched)

    def __str__(self) -> str:
        return f"{self.op} ({self.kind}) in {self.module or 'the model'} at {self.where}"


def _devices(value: Any) -> list[torch.device]:
    return [leaf.device for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _copy_targets(name: str, args: tuple, kwargs: dict) -> list[torch.device]:
    """Where a copy op will write, read from its arguments (before it runs)."""
    if name == "_to_copy":
        device = kwargs.get("device")
        return [torch.device(device)] if device is not None else _devices(args[:1])
    if name == "_copy_from" and len(args) > 1:
        return _devices(args[1])
    return []


def classify(func: Any, args: tuple, kwargs: dict, out: Any = None, *, ran: bool = True) -> str | None:
    """The kind of hostility of one dispatched op (see the module docstring), or None for a harmless one.

    ``func`` is an ``OpOverload``; ``out`` what it returned. With ``ran=False`` the op has not run
    yet (a capture deciding whether to make it a break): copies are then judged by their arguments.
    """
    namespace, name = func.namespace, func._schema.name.split("::")[-1]
    if namespace in _COLLECTIVE_NAMESPACES:
        return "collective"
    if namespace != "aten":
        return None
    if name in _SYNCS:
        return "host sync"
    if name in _DYNAMIC:
        return "data-dependent shape"
    if name in _FROM_PYTHON:
        return "tensor from Python data"
    if name in ("index", "index_put", "index_put_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            return "data-dependent shape"
        return None
    if name in _COPIES:
        sources = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        targets = _devices(out) if ran else _copy_targets(name, args, kwargs)
        if name == "copy_" and args:
            targets, sources = [args[0].device], [t for t in sources if t is not args[0]]
        if any(d.type == "cuda" for d in targets) and any(
            s.device.type == "cpu" and not s.is_pinned() for s in sources
        ):
            return "copy from host memory"
        if any(d.type == "cpu" for d in targets) and any(s.device.type == "cuda" for s in sources):
            return "host sync"
    return None


def user_frame() -> str:
    """The innermost frame outside PyTorch and this package: the model's own line."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith((_TORCH_DIR, _OUR_DIR)):
            return f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    return "?"


def innermost_module(names: dict[int, str]) -> str:
    """The path (a value of ``names``, keyed by ``id(module)``) of the innermost module whose method
    is running now, read from the call stack; "" when none of them is."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in names:
            return names[id(owner)]
        frame = frame.f_back
    return ""


class HostileOpFinder(TorchDispatchMode):
    """Notes the hostile ops of the code run under it (see the module docstring); ``found`` lists them
    in order, each once. Ops inside an :func:`~bcg_diffusion.core.graphs.eager_break` are not noted: the
    break already keeps them out of the graph. Module paths are relative to ``root`` (default: the
    outermost module called under the finder)."""

    # Compiled regions (fast mode's blocks, run through graphs.call_untracked) run with the finder
    # popped: torch.compile refuses to run under a dispatch mode.
    pauses_for_compiled_code = True

    def __init__(self, root: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.found: list[HostileOp] = []
        self._seen: set[HostileOp] = set()
        self._modules: list[torch.nn.Module] = []
        self._names: dict[int, str] = {id(m): name for name, m in root.named_modules()} if root is not None else {}
        self._handles: list[Any] = []

    def __enter__(self) -> HostileOpFinder:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [register_module_forward_pre_hook(self._enter), register_module_forward_hook(self._leave)]
        graphs._FINDERS[0] += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        graphs._FINDERS[0] -= 1
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return super().__exit__(*exc)

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if not self._names:  # the outermost module names the rest
            self._names = {id(m): name for name, m in module.named_modules()}
        self._modules.append(module)

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._modules and self._modules[-1] is module:
            self._modules.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not graphs._IN_BREAK.get():
            kind = classify(func, args, kwargs, out)
            if kind is not None:
                module = self._names.get(id(self._modules[-1]), "") if self._modules else ""
                on_gpu = kind == "tensor from Python data" and any(d.type == "cuda" for d in _devices(out))
                op = HostileOp(str(func), kind, module, user_frame(), on_gpu)
                if op not in self._seen:
                    self._seen.add(op)
                    self.found.append(op)
        return out
