"""Fast mode with ``quantize="fp8"``: an attention's query, key and value projections as one FP8 product,
in the memory of the three.

Z-Image projects each token three times from the same input, with three 3,840 x 3,840 products.
In FP8 at 512² (1,088 tokens) each is too small to fill an H200: the three took 122.5 µs, one
product over their concatenated weights 74.9 µs (1.64x), and 298.0 against 265.8 µs at 1024²
(run 114, ``bench.probes.probe_outside_blocks --sections gemms``). In bf16 the fusion gains nothing
measurable (0.996x and 1.011x), so only the FP8 model is fused.

How: torchao's row-wise FP8 quantizes each output row of a weight on its own, so quantizing the
concatenation of the three original weights (``quantize_transformer`` keeps them on the CPU) gives
the rows and scales the three quantized weights hold. That is checked, not assumed: each projection's
weight is compared with its rows of the fused one (values and torchao's settings), and where all three
are equal each projection's weight becomes those rows, a view, so the fused weight costs no memory of
its own (1.4 GiB saved for Z-Image's 34 attentions against keeping both, run 125); where they are not,
the module is left apart. The fused linear hangs on the attention module as
:data:`~bcg_diffusion.patches.attention.FUSED_QKV_ATTRIBUTE`, and fast mode's processor (Z-Image's,
:mod:`bcg_diffusion.patches.attention`) splits its output into the query, key and value. The products'
inputs are the same; only the kernel may round differently (on the H200 it gave the same bytes, run
115), which is why this is fast mode's (its images stay byte-identical with and without graphs).

The feed-forward's two up projections (``w1``, ``w3``) were stacked the same way and measured: 1.10x
faster as products alone at 512² (run 114), but no faster end to end at either size (runs 125 and 126,
each mode order once), so they stay apart.

:func:`choose` turns it off per model (``choose(pipe.transformer, False)`` before ``accelerate``).
Refused, with the separate products kept: a module whose three projections are not plain linears that
``quantize="fp8"`` quantized, with the same input width and no bias. At each pipeline call (each
transformer call outside one) the three projections are checked (the same modules holding the same weight objects, their tensors not
written in place since): a projection replaced (a LoRA layer) or its weights changed drops that
module's fusion for good, logged at INFO. Dropping it changes the attribute the processor reads, so the
graphs that read it are captured again and the compiled blocks recompile.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.hooks import MethodPatches
from ..core.python_state import current_scope
from ..patches.attention import FUSED_QKV_ATTRIBUTE, FUSED_QKV_PROCESSORS
from .base import Feature, Setup, Target
from .quantization import FP8, Quantized, keeping_global_settings

__all__ = ["FUSED_QKV_CHOICE", "FusedQkv", "choose", "fuse_qkv", "unfuse"]

logger = logging.getLogger(__name__)

_PROJECTIONS = ("to_q", "to_k", "to_v")
# The attribute on an attention module that keeps its projections apart when False (set before
# ``accelerate``; :func:`choose` sets it on every attention module).
FUSED_QKV_CHOICE = "_bcg_fused_qkv"


def choose(model: torch.nn.Module, fused: bool) -> int:
    """Let (``fused=True``, the default) or keep (False) ``model``'s attention modules from projecting
    their query, key and value in one product, before ``accelerate``. Returns how many modules it set.

    >>> choose(pipe.transformer, False)  # doctest: +SKIP
    """
    if not isinstance(fused, bool):
        raise TypeError(f"fused must be True or False, got {fused!r}")
    modules = [m for m in model.modules() if all(hasattr(m, p) for p in _PROJECTIONS)]
    for module in modules:
        setattr(module, FUSED_QKV_CHOICE, fused)
    return len(modules)


def _inner_names(weight: torch.Tensor) -> tuple[str, ...]:
    """The attributes of ``weight`` holding the tensors with its values (a tensor subclass's, such as
    torchao's ``qdata`` and ``scale``); none for a plain tensor."""
    if getattr(type(weight), "__tensor_flatten__", None) is None:
        return ()
    names, _ = weight.__tensor_flatten__()
    return tuple(names)


def _inner(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``weight``'s tensors that hold its values (the inner ones of a tensor subclass such as torchao's)."""
    names = _inner_names(weight)
    return tuple(getattr(weight, name) for name in names) if names else (weight,)


@dataclass
class _Fused:
    """One attention module's fusion: its three projections and weights as fused, the tensors holding
    those weights' values (each weight's ``(attribute, tensor)`` pairs; a plain tensor's is ``("", itself)``)
    and their version counters then (every in-place write bumps them)."""

    name: str
    attention: torch.nn.Module
    projections: tuple[torch.nn.Module, ...]
    weights: tuple[torch.Tensor, ...]
    inner: tuple[tuple[tuple[str, torch.Tensor], ...], ...]
    versions: list[int]

    def stale(self) -> str | None:
        """Why the fused product no longer equals the three (None: it does)."""
        for name, module, weight, inner in zip(_PROJECTIONS, self.projections, self.weights, self.inner, strict=True):
            if getattr(self.attention, name, None) is not module:
                return f"{name} was replaced"
            if module.weight is not weight:
                return f"{name}.weight was replaced"
            if any(attribute and getattr(weight, attribute) is not tensor for attribute, tensor in inner):
                return f"{name}.weight's data was replaced"
        if [t._version for held in self.inner for _, t in held] != self.versions:
            return "a projection's weight was written in place"
        return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same values the same way: one tensor class, equal settings (a
    subclass's flatten context: torchao's block size, product and activation settings), equal bytes."""
    if type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if getattr(type(a), "__tensor_flatten__", None) is not None and (
        a.__tensor_flatten__()[1] != b.__tensor_flatten__()[1]
    ):
        return False
    return all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(_inner(a), _inner(b), strict=True)
    )


def _original_weight(done: Quantized, name: str) -> torch.Tensor | None:
    original = done.originals.get(name)
    return None if original is None else original.weight


def fuse_qkv(model: torch.nn.Module, done: Quantized) -> list[_Fused]:
    """Give every attention module of ``model`` that fast mode's processors read fused
    (:data:`FUSED_QKV_PROCESSORS`), and whose ``to_q``, ``to_k`` and ``to_v`` :func:`quantize_transformer`
    quantized (``done``) with equal input widths and no bias, a submodule
    :data:`FUSED_QKV_ATTRIBUTE`: one linear over the three original weights, quantized with
    ``done.config``, which must quantize each output row on its own (torchao's row-wise FP8: then the
    fused weight holds exactly the three quantized weights, which is checked). Each projection's weight
    then becomes its rows of the fused one, a view. Returns the fusions made; :func:`unfuse` takes each
    away.

    The submodule is registered (it moves with the model and is in its ``state_dict`` while fused).
    """
    from torchao.quantization import quantize_

    fused: list[_Fused] = []
    for name, attention in model.named_modules():
        if type(getattr(attention, "processor", None)).__name__ not in FUSED_QKV_PROCESSORS:
            continue
        if getattr(attention, FUSED_QKV_CHOICE, True) is False:
            continue
        projections = tuple(getattr(attention, p, None) for p in _PROJECTIONS)
        prefix = f"{name}." if name else ""
        originals = [_original_weight(done, prefix + p) for p in _PROJECTIONS]
        if any(o is None for o in originals) or any(
            type(m) is not torch.nn.Linear or m.bias is not None for m in projections
        ):
            continue
        if len({o.shape[1] for o in originals}) != 1 or len({type(m.weight) for m in projections}) != 1:
            continue
        weight = projections[0].weight
        joined = torch.cat(originals).to(device=weight.device)
        linear = torch.nn.Linear(joined.shape[1], joined.shape[0], bias=False, device="meta")
        linear.weight = torch.nn.Parameter(joined, requires_grad=False)
        with keeping_global_settings():
            quantize_(linear, done.config)  # row-wise: the three quantized weights' rows and scales, stacked
        ends = itertools.accumulate(m.weight.shape[0] for m in projections)
        rows = [linear.weight[end - m.weight.shape[0] : end] for m, end in zip(projections, ends, strict=True)]
        if not all(_same(part, m.weight) for part, m in zip(rows, projections, strict=True)):
            logger.info("fast mode: %s: the fused weight is not the three quantized ones; kept apart", name)
            continue
        for part, module in zip(rows, projections, strict=True):
            module.weight = torch.nn.Parameter(part, requires_grad=False)  # a view: the memory is shared
        attention.add_module(FUSED_QKV_ATTRIBUTE, linear)
        weights = tuple(m.weight for m in projections)
        inner = tuple(tuple(zip(_inner_names(w) or ("",), _inner(w), strict=True)) for w in weights)
        versions = [t._version for held in inner for _, t in held]
        fused.append(_Fused(name, attention, projections, weights, inner, versions))
    return fused


def unfuse(fused: _Fused) -> None:
    """Take ``fused``'s linear off its attention module (nothing to do if it is gone already). The
    projections keep their weights, rows of the fused one."""
    fused.attention._modules.pop(FUSED_QKV_ATTRIBUTE, None)


class FusedQkv(Feature):
    name = "fused query, key and value"
    component = "transformer"
    experts = True  # Wan 2.2's second expert too
    defaults = {"fused_qkv": 0, "fused_qkv_dropped": 0}

    def __init__(self) -> None:
        self.fused: list[_Fused] = []  # in use
        self.made: list[_Fused] = []  # every fusion made, for restore
        self.dropped = 0
        self._checked_scope: int | None = None

    @classmethod
    def create(cls, setup: Setup) -> FusedQkv | None:
        fast_fp8 = setup.config.mode == "fast" and setup.config.quantize == FP8
        if not fast_fp8 or "transformer" not in setup.accelerated:
            return None
        return cls()

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        done: Quantized | None = setup.quantized
        if done is None:
            return
        self.made = fuse_qkv(setup.modules["transformer"], done)
        self.fused = list(self.made)
        logger.info("fast mode: %d attention modules project query, key and value in one product", len(self.fused))

    def wrap_call(self, target: Target, call: Callable[..., Any]) -> Callable[..., Any]:
        if target.component != "transformer" or not self.fused:
            return call

        def checked(*args: Any, **kwargs: Any) -> Any:
            self._drop_stale()
            return call(*args, **kwargs)

        return checked

    def _drop_stale(self) -> None:
        """Drop the fusions whose projections changed since they were fused (see the module docstring).
        Once per pipeline call, as the check of the Python state the graphs read (every call outside one)."""
        scope = current_scope()
        number = scope[0] if scope is not None else None
        if number is not None and number == self._checked_scope:
            return
        self._checked_scope = number
        kept = []
        for fused in self.fused:
            reason = fused.stale()
            if reason is None:
                kept.append(fused)
                continue
            self.dropped += 1
            unfuse(fused)
            logger.info(
                "fast mode: %s: %s; its query, key and value are projected apart from now on", fused.name, reason
            )
        self.fused = kept

    def before_undo(self) -> None:
        for fused in self.made:
            unfuse(fused)
        self.fused, self.made = [], []

    def stats(self) -> dict[str, Any]:
        return {"fused_qkv": len(self.fused), "fused_qkv_dropped": self.dropped}
