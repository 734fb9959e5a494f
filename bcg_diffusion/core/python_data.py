"""Tensors a forward builds on the GPU from Python data, held as constants of its graph.

``torch.tensor([0, 1, 1], device="cuda")`` copies its data from host memory inside the constructor,
below the dispatcher, and CUDA refuses that copy in a capture. The tensor's value is a function of
Python data only, so within one signature it is as fixed as every other Python decision a graph
bakes in (the shapes, the branches taken, ``img_shapes``). Nothing needs to run eagerly for it:
the value only has to reach the GPU before the graph needs it.

:class:`PythonDataConstants` is a torch-function mode that sees ``torch.tensor``, ``torch.as_tensor``,
``torch.asarray`` and ``Tensor.new_tensor`` calls that build on the capture's device from data holding
no tensor. Under :meth:`~PythonDataConstants.recording` (each eager warm-up before a capture) it notes
every such tensor, in call order, with its value. Under :meth:`~PythonDataConstants.serving` (the
capture) the same call builds its value on the CPU only; when every warm-up built that value at that
position, the call returns a copy of the first warm-up's tensor: a device-to-device copy that the
graph records, so each replay writes the value again and an in-place change by the model never
reaches the next replay. The copy served from is taken when the warm-up builds the tensor, before the
model can change it, and is held with the graph.

A value that is not the same in every warm-up and in the capture (a call counter, a clock) is no
constant: the call runs as written, the capture fails, and the runner's retry makes the enclosing
module an eager break (:mod:`bcg_diffusion.core.auto_breaks`). It is listed in ``unstable``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from . import graphs, python_state
from .hostile import HostileOp, innermost_module, user_frame

__all__ = ["KIND", "PythonDataConstants"]

KIND = "tensor from Python data, held as a graph constant"
# The constructors whose data argument can be Python data; new_tensor's first argument is its tensor.
_CONSTRUCTORS = {torch.tensor, torch.as_tensor, torch.asarray}
_NEW_TENSOR = torch.Tensor.new_tensor


@dataclass
class _Built:
    """One tensor a warm-up built from Python data: its value on the CPU, and a device copy of it taken
    as it was built (the model's own tensor may be changed in place afterwards)."""

    site: HostileOp
    value: torch.Tensor
    tensor: torch.Tensor


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN equal to NaN, -0.0 not equal to 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class PythonDataConstants(TorchFunctionMode):
    """Records, then serves as graph constants, the tensors a forward builds on ``device_type`` from
    Python data (see the module docstring). One instance per capture: :meth:`recording` once per warm-up,
    then :meth:`serving` around each capture attempt.

    ``names`` maps ``id(module)`` to its path, for the sites in ``served`` and ``unstable``
    (:class:`~bcg_diffusion.core.hostile.HostileOp`, listed once each). ``kept`` holds the warm-up tensors
    a captured graph copies from: keep it as long as the graph.

    Example (``model`` builds ``torch.tensor(shapes, device="cuda")`` in its forward)::

        constants = PythonDataConstants(dict((id(m), n) for n, m in model.named_modules()))
        with constants.recording():
            model(x)  # warm-up, eager
        with constants.serving():
            graph, out = capture_breakable(lambda: model(x), pool)
    """

    # graphs.call_untracked takes it off the mode stack around compiled regions: torch.compile guards
    # on that stack (a block compiled by inductor builds its constants itself).
    pauses_for_compiled_code = True

    def __init__(self, names: dict[int, str] | None = None, device_type: str = "cuda") -> None:
        super().__init__()
        self.names = names or {}
        self.device_type = device_type
        self._runs: list[list[_Built]] = []
        self._serving = False
        self._position = 0
        self.served: list[HostileOp] = []
        self.unstable: list[HostileOp] = []
        self.kept: list[torch.Tensor] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Note the tensors built from Python data by the code run under it (one warm-up)."""
        self._runs.append([])
        self._serving = False
        with self:
            yield

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Give the code run under it (one capture) copies of the recorded tensors, in call order."""
        self._serving, self._position = True, 0
        try:
            with self:
                yield
        finally:
            self._serving = False

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        if not self._builds_here(func, args, kwargs):
            return func(*args, **kwargs)
        with graphs.host_work():
            # cloned: as_tensor and asarray share a NumPy array's memory, which may change before the capture
            value = func(*args, **{**kwargs, "device": "cpu"}).clone()
        if not self._serving:
            python_state.note_data(f"the data of {self._site(func)}", self._data(func, args, kwargs))
            tensor = func(*args, **kwargs)
            # The graph copies from a private copy taken now: the forward may change the tensor it was
            # given in place (``ids += 10``), and the capture must be served the value as built.
            self._runs[-1].append(_Built(self._site(func), value, tensor.clone()))
            return tensor
        position, self._position = self._position, self._position + 1
        built = [run[position] if position < len(run) else None for run in self._runs]
        with graphs.host_work():
            stable = bool(built) and all(b is not None and _same(b.value, value) for b in built)
        if not stable:
            _note(self.unstable, self._site(func))
            return func(*args, **kwargs)  # a capture refuses it: the runner learns a module break
        first = built[0]
        _note(self.served, first.site)
        if not any(kept is first.tensor for kept in self.kept):
            self.kept.append(first.tensor)
        return first.tensor.clone()

    @staticmethod
    def _data(func: Any, args: tuple, kwargs: dict) -> Any:
        """The Python data a constructor call builds from."""
        if func is _NEW_TENSOR:
            return args[1] if len(args) > 1 else kwargs.get("data")
        return args[0] if args else kwargs.get("data", kwargs.get("obj"))

    def _builds_here(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Whether ``func(*args, **kwargs)`` builds a tensor on ``device_type`` from data with no tensor."""
        if func in _CONSTRUCTORS:
            device = kwargs.get("device")
            device = torch.get_default_device() if device is None else torch.device(device)
        elif func is _NEW_TENSOR and args:
            device = kwargs.get("device")
            device = args[0].device if device is None else torch.device(device)
        else:
            return False
        if device.type != self.device_type:
            return False
        return not any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(self._data(func, args, kwargs)))

    def _site(self, func: Any) -> HostileOp:
        name = "Tensor.new_tensor" if func is _NEW_TENSOR else f"torch.{func.__name__}"
        return HostileOp(name, KIND, innermost_module(self.names), user_frame(), on_gpu=True)


def _note(sites: list[HostileOp], site: HostileOp) -> None:
    if site not in sites:
        sites.append(site)
