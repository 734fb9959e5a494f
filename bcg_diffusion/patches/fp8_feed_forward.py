"""Fast mode under FP8: a feed-forward's activation and its down projection's FP8 input in one kernel.

A feed-forward runs its up projection(s), the activation, then its down projection: diffusers'
``FeedForward`` with ``activation_fn="gelu-approximate"`` (Qwen-Image's) a tanh GELU, Z-Image's
``FeedForward`` ``silu(w1(x)) * w3(x)``. With torchao's row-wise dynamic FP8 weights (``quantize="fp8"``),
the down projection quantizes its input first: each row's scale from its largest magnitude, the row
divided by it and cast to float8. Compiled, that activation and quantization are one inductor kernel that
spends its time in float32 arithmetic (libdevice's tanh, a rounded division per element): 0.31 ms of a
3.0 ms Qwen-Image FP8 block at 1024² with CFG, about 1 TB/s (H200, runs 95–97). The patched forward runs
the up projections as torchao does, then our kernel (:mod:`bcg_diffusion.kernels.activation_fp8`; for
Qwen-Image 0.11 ms, 2.9 TB/s), and hands its float8 rows and scales to torchao's own product for the down
projection, which then quantizes nothing. Qwen-Image 1024², 50 steps, CFG 4: 9.71 → 9.19 s (run 97).

The same steps as the unpatched forward (the model's activation, torchao's scale and cast, torchao's
product): on a CPU, where the operators run their PyTorch references, the patched forward gives the
unpatched one's bytes. On a GPU the kernel's arithmetic is a few float32 ulps from PyTorch's, which moves
about one float8 value in a hundred by one step (Qwen-Image's PSNR against eager unchanged, 45.0 dB); fast
mode allows it, its contract being with its own compiled blocks, which use the same kernel.

:func:`linear_on_fp8` runs torchao's product on an input quantized already (:class:`Fp8Rows`), as this forward
does for the down projection and fast mode's Z-Image and Qwen-Image blocks
(:mod:`bcg_diffusion.patches.zimage_block`, :mod:`bcg_diffusion.patches.qwenimage_block`) for the products
of their blocks.

On by default (:data:`FP8_FEED_FORWARD_DEFAULT`); an attribute on a feed-forward module
(:data:`FP8_FEED_FORWARD_ATTRIBUTE`, ``"fused"`` or ``"torchao"``) chooses for that module, read when
``accelerate`` prepares the model. Applies only where torchao itself would run its PyTorch kernels
(row-wise scales for weights and activations, float8_e4m3fn, no bounds on the scales, without the
``mslk`` package): :func:`unfit` says why a module is left as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..core.hooks import MethodPatches
from .followed import installable

__all__ = [
    "FP8_FEED_FORWARD_ATTRIBUTE",
    "FP8_FEED_FORWARD_CHOICES",
    "FP8_FEED_FORWARD_DEFAULT",
    "FP8_FEED_FORWARD_PATCH",
    "Fp8Rows",
    "choose",
    "fused_forward",
    "gelu_feed_forward_on_fp8",
    "gelu_feed_forward_ready",
    "linear_on_fp8",
    "patch_fp8_feed_forwards",
    "plain_fp8_linear",
    "unfit",
    "unfit_chosen",
    "unfit_float8_weight",
    "unfit_fp8_projections",
    "unfit_weight",
]

FP8_FEED_FORWARD_PATCH = "FP8 feed-forward: the activation and the down projection's input in one kernel"
FP8_FEED_FORWARD_ATTRIBUTE = "_bcg_fp8_feed_forward"
FP8_FEED_FORWARD_CHOICES = ("torchao", "fused")
FP8_FEED_FORWARD_DEFAULT = "fused"  # bench mode fast-fp8-torchao-ff runs without it
_Z_IMAGE = "diffusers.models.transformers.transformer_z_image"


def _mslk_installed() -> bool:
    """Whether torchao would pick mslk's kernels where the preference is AUTO (its own check where it has
    one; else whether the package is there)."""
    try:
        from torchao.utils import _is_mslk_available
    except ImportError:
        import importlib.util

        return importlib.util.find_spec("mslk") is not None
    return _is_mslk_available()


def unfit_weight(weight: Any) -> str | None:
    """Why ``weight`` is not a torchao FP8 weight with row-wise scales whose activations torchao
    quantizes row-wise with its PyTorch kernels (None: it is): :func:`unfit_float8_weight`, and torchao
    would not pick mslk's kernels (installed)."""
    reason = unfit_float8_weight(weight)
    if reason is not None:
        return reason
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import KernelPreference

    preferences = (weight.kernel_preference, weight.act_quant_kwargs.kernel_preference)
    if KernelPreference.AUTO in preferences and _mslk_installed():
        return "torchao would run mslk's kernels (installed), not PyTorch's"
    return None


def unfit_float8_weight(weight: Any) -> str | None:
    """Why ``weight`` is not a torchao FP8 weight with row-wise scales whose activations are quantized
    row-wise in e4m3, kernel preference AUTO or TORCH (None: it is). Types and attributes only, so that
    compiled code can ask too (dynamo guards on them); :func:`unfit_weight` adds the installed packages."""
    if type(weight) in (torch.Tensor, torch.nn.Parameter):
        return "the projection's weight is not a torchao Float8Tensor"  # no need to import torchao
    try:
        from torchao.quantization import PerRow
        from torchao.quantization.quantize_.workflows import Float8Tensor, QuantizeTensorToFloat8Kwargs
        from torchao.quantization.quantize_.workflows.float8.float8_tensor import KernelPreference
    except ImportError as error:
        return f"torchao's FP8 tensors cannot be imported ({error})"
    if not isinstance(weight, Float8Tensor):
        return "the projection's weight is not a torchao Float8Tensor"
    if tuple(weight.block_size) != (1, weight.shape[-1]) or weight.qdata.dtype != torch.float8_e4m3fn:
        return "the weight is not float8_e4m3fn with one scale per row"
    if weight.mm_config is None:
        return "the weight has no FP8 product settings (a weight-only config's)"
    act = weight.act_quant_kwargs
    if not isinstance(act, QuantizeTensorToFloat8Kwargs) or not isinstance(act.granularity, PerRow):
        return "the activations are not quantized per row"
    if act.float8_dtype != torch.float8_e4m3fn or act.hp_value_lb is not None or act.hp_value_ub is not None:
        return "the activations' float8 dtype or scale bounds are not the defaults"
    preferences = (weight.kernel_preference, act.kernel_preference)
    if any(p not in (KernelPreference.AUTO, KernelPreference.TORCH) for p in preferences):
        return "a kernel preference other than AUTO or TORCH"
    return None


@dataclass(frozen=True)
class _Parts:
    """Where a feed-forward keeps what the fused forward runs: its up projections (the activation's input
    first, then SwiGLU's other factor), its dropout (None: it has none) and its down projection."""

    swiglu: bool
    projections: tuple[torch.nn.Module, ...]
    dropout: torch.nn.Module | None
    down: torch.nn.Module

    def dropping(self) -> bool:
        return bool(self.dropout is not None and self.dropout.p and self.dropout.training)

    def held_by(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` still holds these very parts (identity checks only, which dynamo traces
        into guards)."""
        if self.swiglu:
            return module.w1 is self.projections[0] and module.w3 is self.projections[1] and module.w2 is self.down
        net = module.net  # its activation may have been replaced by a module without a projection
        return getattr(net[0], "proj", None) is self.projections[0] and net[1] is self.dropout and net[2] is self.down


def _locate(module: torch.nn.Module) -> _Parts | str:
    """The parts of diffusers' ``FeedForward`` with a tanh GELU or of Z-Image's SwiGLU ``FeedForward``, or
    why ``module`` is neither."""
    if type(module).__name__ != "FeedForward":
        return "not a diffusers FeedForward"
    if type(module).__module__ == _Z_IMAGE:
        parts = tuple(getattr(module, name, None) for name in ("w1", "w3", "w2"))
        if not all(isinstance(part, torch.nn.Module) for part in parts):
            return "Z-Image's FeedForward without its w1, w2 and w3"
        return _Parts(swiglu=True, projections=parts[:2], dropout=None, down=parts[2])
    net = getattr(module, "net", None)
    if not isinstance(net, torch.nn.ModuleList) or len(net) != 3:
        return "its net is not [activation, dropout, projection]"
    gelu, dropout, down = net
    if type(gelu).__name__ != "GELU" or getattr(gelu, "approximate", None) != "tanh":
        return "its activation is not diffusers' tanh GELU"
    if not isinstance(dropout, torch.nn.Dropout):
        return "its net's second module is not a dropout"
    return _Parts(swiglu=False, projections=(getattr(gelu, "proj", None),), dropout=dropout, down=down)


def unfit(module: torch.nn.Module) -> str | None:
    """Why ``module`` does not take :func:`fused_forward` (None: it does): it must be diffusers'
    ``FeedForward`` holding a tanh ``GELU``, or Z-Image's SwiGLU ``FeedForward``, with a dropout (if any)
    that drops nothing, its projections plain ``nn.Linear`` with torchao row-wise FP8 weights
    (:func:`unfit_weight`)."""
    parts = _locate(module)
    if isinstance(parts, str):
        return parts
    if parts.dropping():
        return "its dropout drops values"
    linears = (*parts.projections, parts.down)
    if any(type(linear) is not torch.nn.Linear for linear in linears):
        return "a projection is not a plain nn.Linear (LoRA or another wrapper)"
    for linear in linears:
        reason = unfit_weight(linear.weight)
        if reason is not None:
            return reason
    return None


def fused_forward(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """A forward for ``module`` (one that :func:`unfit` accepts) with the activation and the down
    projection's input quantization in one kernel; the projections' weights are read at each call.
    Should a projection be replaced later (a LoRA layer wrapping it), a weight stop being a torchao FP8
    tensor or the dropout start dropping (training), the module's own forward runs instead."""
    from torchao.quantization.quantize_.workflows import Float8Tensor

    from ..kernels.activation_fp8 import gelu_fp8, swiglu_fp8

    parts = _locate(module)
    kernel = swiglu_fp8 if parts.swiglu else gelu_fp8
    original = type(module).forward

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        weight = parts.down.weight
        if (
            not parts.held_by(module)
            or parts.dropping()
            or not isinstance(weight, Float8Tensor)
            or not all(isinstance(projection.weight, Float8Tensor) for projection in parts.projections)
        ):
            return original(module, hidden_states, *args, **kwargs)
        # torchao's FP8 products, their activation quantized as always
        ups = [projection(hidden_states) for projection in parts.projections]
        data, scale = kernel(*ups)
        return linear_on_fp8(parts.down, data, scale, ups[0].dtype)

    return forward


def plain_fp8_linear(module: Any, float8_tensor: type) -> bool:
    """Whether ``module`` is a plain ``nn.Linear`` holding a weight of type ``float8_tensor`` (torchao's
    ``Float8Tensor``, passed in so that a compiled forward need not import it): a LoRA layer put in its
    place computes more than its weight, which a path running :func:`linear_on_fp8` on the weight would
    skip."""
    return type(module) is torch.nn.Linear and isinstance(module.weight, float8_tensor)


class Fp8Rows(NamedTuple):
    """An input already quantized per row, as torchao would quantize it for a row-wise FP8 weight: ``data``
    float8 ``[..., K]``, ``scale`` float32 ``[..., 1]``, and the dtype the input had (the product's output
    dtype). What :func:`linear_on_fp8` takes, and what fast mode's Z-Image block hands its attention."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def linear_on_fp8(
    linear: torch.nn.Linear, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``linear`` (its weight a torchao row-wise FP8 tensor, :func:`unfit`'s conditions) on an input already
    quantized per row (``data`` float8 ``[..., K]``, ``scale`` float32 ``[..., 1]``, as torchao's own
    quantization of the input would give them); the output in ``dtype``. torchao's product, which then
    quantizes nothing."""
    from torchao.quantization.quantize_.workflows import Float8Tensor

    weight = linear.weight
    activation = Float8Tensor(
        data,
        scale,
        block_size=[1] * (data.dim() - 1) + [data.shape[-1]],
        mm_config=weight.mm_config,
        kernel_preference=weight.kernel_preference,
        dtype=dtype,
    )
    # torchao refuses an activation already quantized for a weight that quantizes its own: the same
    # weight without its activation settings runs the same product on ours
    bare = Float8Tensor(
        weight.qdata,
        weight.scale,
        block_size=weight.block_size,
        mm_config=weight.mm_config,
        kernel_preference=weight.kernel_preference,
        dtype=weight.dtype,
    )
    return F.linear(activation, bare, linear.bias)


def gelu_feed_forward_ready(feed_forward: torch.nn.Module, float8_tensor: type) -> bool:
    """Whether ``feed_forward`` still is diffusers' tanh-GELU ``FeedForward`` of plain FP8 projections whose
    dropout drops nothing."""
    net = getattr(feed_forward, "net", None)
    if not isinstance(net, torch.nn.ModuleList) or len(net) != 3:
        return False
    gelu, dropout, down = net
    return (
        type(gelu).__name__ == "GELU"
        and getattr(gelu, "approximate", None) == "tanh"
        and plain_fp8_linear(getattr(gelu, "proj", None), float8_tensor)
        and type(dropout) is torch.nn.Dropout
        and not (dropout.p and dropout.training)
        and plain_fp8_linear(down, float8_tensor)
    )


def gelu_feed_forward_on_fp8(feed_forward: torch.nn.Module, rows: Fp8Rows) -> torch.Tensor:
    """Diffusers' tanh-GELU ``FeedForward`` on quantized rows, as fast mode's FP8 feed-forward runs it."""
    from ..kernels.activation_fp8 import gelu_fp8

    gelu, _, down = feed_forward.net
    data, scales = gelu_fp8(linear_on_fp8(gelu.proj, *rows))
    return linear_on_fp8(down, data, scales, rows.dtype)


def unfit_fp8_projections(attn: torch.nn.Module, names: tuple[str, ...]) -> str | None:
    """Why the projections ``names`` of attention module ``attn`` cannot take FP8 rows (None: they can):
    each must be a plain ``nn.Linear`` holding a torchao row-wise FP8 weight (:func:`unfit_weight`)."""
    for name in names:
        projection = getattr(attn, name, None)
        if type(projection) is not torch.nn.Linear:
            return f"its attention's {name} is not a plain nn.Linear"
        reason = unfit_weight(projection.weight)
        if reason is not None:
            return f"its attention's {name}: {reason}"
    return None


def unfit_chosen(feed_forward: torch.nn.Module, label: str) -> str | None:
    """Why ``feed_forward`` (named ``label`` in the reason) does not run fast mode's FP8 kernel (None: it
    does): it chose another path (:func:`choose`) or :func:`unfit` refuses it."""
    choice = getattr(feed_forward, FP8_FEED_FORWARD_ATTRIBUTE, FP8_FEED_FORWARD_DEFAULT)
    if choice != "fused":
        return f"its {label} chose {choice!r}"
    reason = unfit(feed_forward)
    return None if reason is None else f"its {label}: {reason}"


def _choice(module: torch.nn.Module) -> str:
    choice = getattr(module, FP8_FEED_FORWARD_ATTRIBUTE, FP8_FEED_FORWARD_DEFAULT)
    if choice not in FP8_FEED_FORWARD_CHOICES:
        raise ValueError(
            f"{FP8_FEED_FORWARD_ATTRIBUTE}={choice!r} on {type(module).__name__}: "
            f"expected one of {FP8_FEED_FORWARD_CHOICES}"
        )
    return choice


def choose(model: torch.nn.Module, choice: str) -> int:
    """Set ``choice`` (one of :data:`FP8_FEED_FORWARD_CHOICES`) on every feed-forward of ``model``, read when
    ``accelerate`` prepares it; returns how many. Raises ValueError for another choice.

    >>> choose(pipe.transformer, "torchao")  # doctest: +SKIP
    """
    if choice not in FP8_FEED_FORWARD_CHOICES:
        raise ValueError(f"FP8 feed-forward choice {choice!r}: expected one of {FP8_FEED_FORWARD_CHOICES}")
    chosen = 0
    for module in model.modules():
        if type(module).__name__ == "FeedForward":
            setattr(module, FP8_FEED_FORWARD_ATTRIBUTE, choice)
            chosen += 1
    return chosen


def patch_fp8_feed_forwards(model: torch.nn.Module, patches: MethodPatches) -> int:
    """Give every feed-forward of ``model`` that fits (:func:`unfit`) and chose ``"fused"``
    (:data:`FP8_FEED_FORWARD_ATTRIBUTE`, else :data:`FP8_FEED_FORWARD_DEFAULT`) the forward of
    :func:`fused_forward`, recorded in ``patches``; returns how many. Raises ValueError for a choice that is
    not one of :data:`FP8_FEED_FORWARD_CHOICES`. None is patched (with a warning) when diffusers' feed-forward
    code is not the code :func:`fused_forward` was written for (:mod:`bcg_diffusion.patches.followed`)."""
    fitting = [
        module
        for module in model.modules()
        if type(module).__name__ == "FeedForward" and _choice(module) == "fused" and unfit(module) is None
    ]
    if not fitting or not installable("fp8 feed-forward", stacklevel=4):
        return 0
    for module in fitting:
        patches.replace(module, "forward", fused_forward(module))
    return len(fitting)
