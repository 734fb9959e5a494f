"""Quantized transformers inside graphs: torchao's row-wise FP8 on the repeated blocks' linears.

``accelerate(pipe, quantize="fp8")`` quantizes the transformer with torchao's
``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` (dynamic row-wise FP8
activations, row-wise FP8 weights) before its graphs are captured. It does this through
``torchao.quantization.quantize_``, not with kernels of our own: torchao's FP8 path is what every
peer ships, and it compiles. Only the linears that :func:`default_filter` selects are quantized.
These are the linears inside the blocks of the model's ``_repeated_blocks`` (:func:`block_linears`),
both of whose sides are multiples of 16 (cuBLAS's FP8 GEMM needs that), except three kinds:

* **modulation** (``img_mod``, ``txt_mod``, ``adaLN_modulation``, and the linear of every diffusers
  ``AdaLayerNorm*`` norm: FLUX.1's ``norm1.linear``, ``norm1_context.linear``, ``norm.linear``): they
  run on one vector per sample, so FP8 saves nothing there, and cuBLAS refuses FP8 products with so
  few rows;
* **Qwen-Image's text stream** (``add_q_proj``, ``add_k_proj``, ``add_v_proj``, ``to_add_out``,
  ``txt_mlp``): it runs on the prompt's tokens, a few and rarely a multiple of 16 (the reason torchao
  by hand failed on Qwen-Image with ``CUBLAS_STATUS_NOT_SUPPORTED``);
* **the attention output projections** (``to_out.0``): of the four groups of block linears, FP8
  costs most quality there and saves least time (H200, Z-Image 1024², fast mode: keeping them in
  bf16 gives back 3.2 dB of PSNR against bf16 for 2.7% more time; ``docs/quantization.md``).
  ``quantize_filter=block_linears(pipe.transformer)`` quantizes them too.

Embeddings, norms and the final layer stay in bf16. ``quantize_filter=`` replaces the filter (same
signature as torchao's ``filter_fn``: ``(module, fully_qualified_name) -> bool``). ``quantize=`` also
takes any torchao config object (``Int8WeightOnlyConfig()``...), applied with the same filter.

torchao's configs default to ``set_inductor_config=True``: ``quantize_`` then changes settings of the
whole process (inductor's coordinate-descent tuning, ``torch.set_float32_matmul_precision("high")``).
We keep those as they were (:func:`keeping_global_settings`): the matmul precision would change the
kernels of every float32 product in the process, so graphs captured before would no longer match
the same code run after; and coordinate-descent tuning benchmarks every Triton kernel while fast
mode compiles (on an H200, Z-Image 512² in FP8: a first call of 128 s with it, 12 s without, and
no faster afterwards).

``restore`` gives the original weights back. They are kept on the CPU while quantized, so the GPU
holds the quantized model only. A quantization that fails midway (out of memory, an error in torchao,
an interrupt) gives them back too, and the modules torchao swapped in, before its error goes on with a
note saying so: the model is left as it was, never partly quantized.

A transformer that the user quantized with torchao *before* ``accelerate`` needs nothing from this
module: its tensor subclasses are captured like any weight (see
:class:`~bcg_diffusion.core.graphs.GraphPool` for how the capture keeps them alive). Its ``quantize_``
call ran outside our control, so pass ``set_inductor_config=False`` to its config there for the
reasons above.

The :class:`Quantization` feature runs :func:`quantize_transformer` before fast mode compiles the
blocks, reports what it did, and gives the original weights back on ``restore``. A quantization that
fails midway has given them back itself before its error leaves ``prepare``, so ``accelerate`` undoes
the rest and raises it with the transformer as it was. A transformer quantized by the user beforehand
needs no quantizing: its weights are reported (``stats()["quantized"]``) and captured as they are.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import re
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.hooks import MethodPatches
from ..core.runner import BCGWarning
from .base import Feature, Setup

__all__ = [
    "FP8",
    "Quantization",
    "MIN_FP8_CAPABILITY",
    "OriginalLinear",
    "Quantized",
    "block_linears",
    "default_filter",
    "dequantize",
    "quantize_transformer",
]

FP8 = "fp8"
MIN_FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores

_MODULATION = re.compile(r"(^|\.)(img_mod|txt_mod|adaLN_modulation)(\.|$)")
# diffusers' adaptive norms (AdaLayerNormZero, AdaLayerNormZeroSingle, AdaLayerNormContinuous...): their
# linear maps the timestep embedding, one row per sample, to the block's shifts, scales and gates.
_MODULATION_NORMS = ("AdaLayerNorm",)
_TEXT_STREAM = re.compile(r"(^|\.)(add_q_proj|add_k_proj|add_v_proj|to_add_out|txt_mlp)(\.|$)")
_ATTENTION_OUT = re.compile(r"(^|\.)to_out\.0$")

Filter = Callable[[torch.nn.Module, str], bool]

logger = logging.getLogger(__name__)


def block_linears(model: torch.nn.Module) -> Filter:
    """Every linear of ``model``'s repeated blocks that FP8 can take: both sides multiples of 16, not
    modulation, not Qwen-Image's text stream (see the module docstring).

    Returns a torchao ``filter_fn``. Raises ValueError when ``model`` declares no ``_repeated_blocks``.
    """
    classes = tuple(getattr(model, "_repeated_blocks", None) or ())
    if not classes:
        raise ValueError(f"{type(model).__name__} declares no _repeated_blocks: pass quantize_filter= to choose")
    selected = set()
    for block_name, block in model.named_modules():
        if type(block).__name__ not in classes:
            continue
        modulation = {
            f"{name}.{child}"
            for name, module in block.named_modules()
            if type(module).__name__.startswith(_MODULATION_NORMS)
            for child, _ in module.named_modules()
            if child
        }
        for name, module in block.named_modules():
            if not isinstance(module, torch.nn.Linear) or _MODULATION.search(name) or _TEXT_STREAM.search(name):
                continue
            if name in modulation:
                continue
            if module.in_features % 16 or module.out_features % 16:
                continue
            selected.add(f"{block_name}.{name}")
    return lambda module, fqn: fqn in selected


def default_filter(model: torch.nn.Module) -> Filter:
    """The linears of ``model`` that ``quantize="fp8"`` quantizes by default: :func:`block_linears`
    less the attention output projections (``to_out.0``), which FP8 costs most quality in.

    >>> accelerate(pipe, quantize="fp8", quantize_filter=block_linears(pipe.transformer))  # doctest: +SKIP

    quantizes those too (faster, less exact). Raises ValueError as :func:`block_linears` does.
    """
    candidates = block_linears(model)
    return lambda module, fqn: candidates(module, fqn) and not _ATTENTION_OUT.search(fqn)


def torchao_config(quantize: Any) -> Any:
    """The torchao config for ``quantize`` ("fp8" or a torchao config object, returned as it is)."""
    if quantize != FP8:
        return quantize
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)


# What torchao's ``set_inductor_config=True`` changes (torchao.quantization.utils.recommended_inductor_config_setter).
_INDUCTOR_SETTINGS = (
    "coordinate_descent_tuning",
    "coordinate_descent_check_all_directions",
    "force_fuse_int_mm_with_mul",
    "fx_graph_cache",
    "triton.unique_kernel_names",
)


@contextlib.contextmanager
def keeping_global_settings() -> Iterator[None]:
    """Give the process's float32 matmul precision and inductor's settings back as they were on exit.

    >>> with keeping_global_settings():                   # doctest: +SKIP
    ...     quantize_(model, Int8WeightOnlyConfig())      # its set_inductor_config=True stays local
    """
    import torch._inductor.config as inductor

    precision = torch.get_float32_matmul_precision()
    per_backend = {owner: owner.fp32_precision for owner in _fp32_precision_owners()}
    current = inductor.get_config_copy()
    settings = {name: current[name] for name in _INDUCTOR_SETTINGS}
    try:
        yield
    finally:
        # Only where something changed them: setting the old API's value again moves the per-backend values
        # from "none" to "ieee", a change in the settings every runner keys its graphs on
        # (core/settings.py), so each pipeline captured before would capture again.
        if torch.get_float32_matmul_precision() != precision or any(
            owner.fp32_precision != value for owner, value in per_backend.items()
        ):
            torch.set_float32_matmul_precision(precision)
            for owner, value in per_backend.items():
                owner.fp32_precision = value
        inductor.load_config(settings)


def _fp32_precision_owners() -> list[Any]:
    """The ``torch.backends`` objects with a ``fp32_precision`` setting in the installed torch (2.9 on)."""
    owners = (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.mkldnn.matmul)
    found = []
    for owner in owners:
        try:
            owner.fp32_precision  # noqa: B018 - a read that raises where the setting does not exist
        except (AttributeError, RuntimeError):
            continue
        found.append(owner)
    return found


def check_fp8_device(device: torch.device) -> None:
    """Raise RuntimeError unless ``device`` is a CUDA GPU with FP8 tensor cores (compute capability 8.9+)."""
    if device.type != "cuda":
        raise RuntimeError(
            f'quantize="fp8" needs a CUDA GPU with compute capability 8.9 or more; the model is on {device}'
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_FP8_CAPABILITY:
        raise RuntimeError(
            f'quantize="fp8" needs FP8 tensor cores (compute capability 8.9 or more: Ada, Hopper, Blackwell); '
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}"
        )


@dataclass(eq=False)
class OriginalLinear:
    """One linear :func:`quantize_transformer` selected, as it was before quantizing, and what quantizing
    left in its place.

    ``weight`` is a CPU copy of its weight's values (the GPU then holds the quantized model only), ``device``
    and ``requires_grad`` where and how it was; ``parameter`` refers weakly to the weight parameter itself,
    so a weight torchao never replaced is kept as that very object. ``parent`` and ``child`` say where the
    module hangs (``parent`` is None for the model itself), ``attributes`` are its instance attributes
    (torchao binds an ``extra_repr`` there). ``placed`` and ``left`` are what quantizing left on the parent
    and in those attributes: giving back undoes only what is still as quantizing left it.
    """

    module: torch.nn.Module
    parent: torch.nn.Module | None
    child: str
    weight: torch.Tensor
    device: torch.device
    requires_grad: bool
    parameter: weakref.ref[torch.Tensor]
    attributes: dict[str, Any]
    placed: torch.nn.Module | None = None
    left: dict[str, Any] = field(default_factory=dict)


@dataclass
class Quantized:
    """What :func:`quantize_transformer` did: the config, the names quantized, the original linears."""

    config: Any
    names: list[str] = field(default_factory=list)
    originals: dict[str, OriginalLinear] = field(default_factory=dict)


def quantize_transformer(model: torch.nn.Module, quantize: Any, filter_fn: Filter | None = None) -> Quantized:
    """Quantize ``model``'s linears chosen by ``filter_fn`` (default: :func:`default_filter`) with
    torchao, in place; keep their original weights on the CPU for :func:`dequantize`.

    Raises ImportError (with the install command) without torchao, RuntimeError for ``"fp8"`` on a
    device without FP8, ValueError when the filter selects nothing. When quantizing fails midway, whatever
    failed (an error in torchao, out of memory, KeyboardInterrupt), every selected linear is given back as
    it was (:func:`dequantize`'s contract) and the same exception is raised again, its type kept, with a
    note (Python 3.11+; logged before) naming the linear it failed at and saying the weights are back. If
    moving a weight back to its device fails too, that error is raised instead (the first one is its
    context), noted with how many linears hold their original weights on the CPU.
    """
    try:
        from torchao.quantization import quantize_
    except ImportError as exc:
        raise ImportError('quantize= needs torchao: pip install "bcg-diffusion[fp8]"') from exc
    device = next(model.parameters()).device
    if quantize == FP8:
        check_fp8_device(device)
    chosen = filter_fn if filter_fn is not None else default_filter(model)
    linears = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and chosen(module, name)
    }
    if not linears:
        raise ValueError(f"the quantize filter selected no linear of {type(model).__name__}")
    done = Quantized(torchao_config(quantize), names=sorted(linears))
    done.originals = {name: _original(model, name, module) for name, module in linears.items()}
    taken: list[str] = []  # the linears torchao took, in its order: the last is the one it failed at

    def selected(module: torch.nn.Module, fqn: str) -> bool:
        if fqn not in linears:
            return False
        taken.append(fqn)
        return True

    try:
        with keeping_global_settings():
            quantize_(model, done.config, filter_fn=selected)
    except BaseException as exc:
        _give_back_after(exc, done, _label(quantize), taken)
        raise
    for original in done.originals.values():
        _mark_left(original)
    return done


def dequantize(done: Quantized) -> None:
    """Put the original linears back as they were before :func:`quantize_transformer`: each weight a plain
    ``nn.Parameter`` with its values, dtype, device and ``requires_grad``, on the module torchao found (where
    torchao swapped in a module of its own and nothing replaced it since), with the instance attributes
    torchao set undone.

    The quantized weights are dropped before any original moves back to its device. Raises what moving a
    weight back raised (out of memory, say), noted: the linears not moved yet hold their original weights on
    the CPU, whole, and ``model.to(device)`` finishes the job once memory is free.
    """
    _restore(done, "bcg-diffusion: giving the transformer's original weights back")


def _original(model: torch.nn.Module, name: str, module: torch.nn.Module) -> OriginalLinear:
    """``model``'s linear ``name`` (``module``) as it is now, its weight copied to the CPU."""
    parent_name, _, child = name.rpartition(".")
    weight = module.weight
    return OriginalLinear(
        module=module,
        parent=model.get_submodule(parent_name) if name else None,
        child=child,
        weight=weight.detach().to("cpu", copy=True),
        device=weight.device,
        requires_grad=weight.requires_grad,
        parameter=weakref.ref(weight),
        attributes=dict(module.__dict__),
    )


def _mark_left(original: OriginalLinear) -> None:
    """Record what quantizing has left in ``original``'s place: the module on its parent, its attributes."""
    original.placed = getattr(original.parent, original.child, None) if original.parent is not None else None
    original.left = dict(original.module.__dict__)


def _give_back_after(exc: BaseException, done: Quantized, label: str, taken: list[str]) -> None:
    """``quantize_`` raised ``exc`` after taking the linears ``taken``: give every linear of ``done`` back
    (:func:`_restore`) and note on ``exc`` that they are back. Raises, noted, what giving back raised."""
    where = f"at {taken[-1]!r} ({len(taken)} of {len(done.names)} linears)" if taken else "before its first linear"
    if isinstance(exc, torch.OutOfMemoryError):
        # The failed call's frames still hold what it was allocating: the weights moving back need that memory.
        traceback.clear_frames(exc.__traceback__)
    for original in done.originals.values():
        _mark_left(original)  # nothing else ran since quantize_ started: all that changed is its doing
    _restore(done, f"bcg-diffusion: quantize={label} failed {where} (the error above)")
    _note(exc, f"bcg-diffusion: quantize={label} failed {where}; the transformer's original weights are back")


def _restore(done: Quantized, why: str) -> None:
    """Give every linear of ``done`` back (:func:`dequantize`'s contract), the quantized weights dropped
    first; ``why`` begins the note on an error from moving a weight back, which is raised again."""
    moving = [original for original in done.originals.values() if _put_back(original)]
    if any(original.device.type != "cpu" for original in moving):
        gc.collect()  # a module torchao swapped in may sit in a reference cycle, its quantized weight with it
    for index, original in enumerate(moving):
        try:
            original.module.weight = torch.nn.Parameter(
                _to_device(original.weight, original.device), requires_grad=original.requires_grad
            )
        except BaseException as exc:
            left, device = len(moving) - index, original.device
            _note(
                exc,
                f"{why}: moving the original weights back to {device} failed; the original weights of {left} "
                f"linear{'s' if left > 1 else ''} are on the CPU, whole: free memory on {device}, then move the "
                f"model with .to({str(device)!r})",
            )
            raise
    done.originals.clear()


def _put_back(original: OriginalLinear) -> bool:
    """Undo on ``original``'s linear what quantizing did and nothing changed since: the module it swapped in
    on the parent, the instance attributes it set; the weight goes back on the CPU, which frees the
    quantized one. Returns whether the weight still has to move to its device."""
    module, parent, placed = original.module, original.parent, original.placed
    if parent is not None and placed is not module and getattr(parent, original.child, None) is placed:
        setattr(parent, original.child, module)
    missing = object()
    for key in {**original.attributes, **original.left}:
        before, after = original.attributes.get(key, missing), original.left.get(key, missing)
        if after is before or module.__dict__.get(key, missing) is not after:
            continue  # not changed by quantizing, or changed again since by someone else
        if before is missing:
            del module.__dict__[key]
        else:
            module.__dict__[key] = before
    if module.weight is original.parameter():
        return False  # torchao never replaced it (a module it swapped out, or one it had not reached)
    module.weight = torch.nn.Parameter(original.weight, requires_grad=original.requires_grad)
    return True


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: where an original weight moves back (the tests make it fail here)."""
    return tensor.to(device)


def _label(quantize: Any) -> str:
    """``quantize`` for a message: ``"fp8"`` or the torchao config's class name."""
    return repr(quantize) if isinstance(quantize, str) else type(quantize).__name__


def _note(exc: BaseException, note: str) -> None:
    """Add ``note`` to ``exc`` (printed under its message); Python 3.10 has no notes, so it is logged there."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        logger.error("%s", note)


def quantized_weights(model: torch.nn.Module) -> dict[str, int]:
    """How many parameters of ``model`` are tensor subclasses (torchao's quantized weights), by class."""
    counts: dict[str, int] = {}
    for parameter in model.parameters():
        if type(parameter) not in (torch.Tensor, torch.nn.Parameter):
            name = type(parameter).__name__
            counts[name] = counts.get(name, 0) + 1
    return counts


class Quantization(Feature):
    name = "quantization"
    component = "transformer"
    experts = True  # Wan 2.2's second expert too
    defaults = {"quantized": None, "quantized_linears": 0}

    def __init__(self, setup: Setup) -> None:
        self.module = setup.modules["transformer"]
        self.option = setup.config.quantize
        self.filter = setup.config.quantize_filter
        self.done: Quantized | None = None

    @classmethod
    def create(cls, setup: Setup) -> Quantization | None:
        if setup.config.quantize is None and not quantized_weights(setup.modules["transformer"]):
            return None
        if setup.config.quantize is not None and "transformer" not in setup.accelerated:
            warnings.warn(
                "bcg-diffusion: quantize= applies to an accelerated transformer; it is not in components",
                BCGWarning,
                stacklevel=4,
            )
            return None
        return cls(setup)

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        # On failure quantize_transformer gives the weights back before raising: self.done stays None.
        if self.option is not None:
            self.done = quantize_transformer(self.module, self.option, self.filter)
            setup.quantized = self.done

    def stats(self) -> dict[str, Any]:
        if self.done is not None:
            return {"quantized": repr(self.done.config), "quantized_linears": len(self.done.names)}
        counts = quantized_weights(self.module)
        described = ", ".join(f"{count} {name}" for name, count in sorted(counts.items()))
        return {"quantized": f"before accelerate: {described}" if counts else None}

    def close(self) -> None:
        if self.done is not None:
            dequantize(self.done)
            self.done = None
