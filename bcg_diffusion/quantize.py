"""Quantized transformers inside graphs: torchao's row-wise FP8 on the repeated blocks' linears.

``accelerate(pipe, quantize="fp8")`` quantizes the transformer with torchao's
``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` (dynamic row-wise FP8
activations, row-wise FP8 weights) before its graphs are captured. It does this through
``torchao.quantization.quantize_``, not with kernels of our own: torchao's FP8 path is what every
peer ships, and it compiles. Only the linears that :func:`default_filter` selects are quantized.
These are the linears inside the blocks of the model's ``_repeated_blocks`` (:func:`block_linears`),
both of whose sides are multiples of 16 (cuBLAS's FP8 GEMM needs that), except three kinds:

* **modulation** (``img_mod``, ``txt_mod``, ``adaLN_modulation``): they run on one vector per
  sample, so FP8 saves nothing there, and cuBLAS refuses FP8 products with so few rows;
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
holds the quantized model only.

A transformer that the user quantized with torchao *before* ``accelerate`` needs nothing from this
module: its tensor subclasses are captured like any weight (see
:class:`~bcg_diffusion.graphs.GraphPool` for how the capture keeps them alive). Its ``quantize_``
call ran outside our control, so pass ``set_inductor_config=False`` to its config there for the
reasons above.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "FP8",
    "MIN_FP8_CAPABILITY",
    "Quantized",
    "block_linears",
    "default_filter",
    "dequantize",
    "quantize_transformer",
]

FP8 = "fp8"
MIN_FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores

_MODULATION = re.compile(r"(^|\.)(img_mod|txt_mod|adaLN_modulation)(\.|$)")
_TEXT_STREAM = re.compile(r"(^|\.)(add_q_proj|add_k_proj|add_v_proj|to_add_out|txt_mlp)(\.|$)")
_ATTENTION_OUT = re.compile(r"(^|\.)to_out\.0$")

Filter = Callable[[torch.nn.Module, str], bool]


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
        for name, module in block.named_modules():
            if not isinstance(module, torch.nn.Linear) or _MODULATION.search(name) or _TEXT_STREAM.search(name):
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
    current = inductor.get_config_copy()
    settings = {name: current[name] for name in _INDUCTOR_SETTINGS}
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        inductor.load_config(settings)


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


@dataclass
class Quantized:
    """What :func:`quantize_transformer` did: the config, the names quantized, the original weights."""

    config: Any
    names: list[str] = field(default_factory=list)
    originals: dict[str, tuple[torch.nn.Module, torch.Tensor, torch.device]] = field(default_factory=dict)


def quantize_transformer(model: torch.nn.Module, quantize: Any, filter_fn: Filter | None = None) -> Quantized:
    """Quantize ``model``'s linears chosen by ``filter_fn`` (default: :func:`default_filter`) with
    torchao, in place; keep their original weights on the CPU for :func:`dequantize`.

    Raises ImportError (with the install command) without torchao, RuntimeError for ``"fp8"`` on a
    device without FP8, ValueError when the filter selects nothing.
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
    for name, module in linears.items():
        done.originals[name] = (module, module.weight.detach().to("cpu", copy=True), module.weight.device)
    with keeping_global_settings():
        quantize_(model, done.config, filter_fn=lambda module, fqn: fqn in linears)
    return done


def dequantize(done: Quantized) -> None:
    """Put the original weights back (on the device they were on)."""
    for module, weight, device in done.originals.values():
        module.weight = torch.nn.Parameter(weight.to(device), requires_grad=False)
    done.originals.clear()


def quantized_weights(model: torch.nn.Module) -> dict[str, int]:
    """How many parameters of ``model`` are tensor subclasses (torchao's quantized weights), by class."""
    counts: dict[str, int] = {}
    for parameter in model.parameters():
        if type(parameter) not in (torch.Tensor, torch.nn.Parameter):
            name = type(parameter).__name__
            counts[name] = counts.get(name, 0) + 1
    return counts
