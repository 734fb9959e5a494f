"""Fast mode: the text encoders' layers compiled by inductor, inside their graphs.

Z-Image encodes each prompt with Qwen3-4B: 36 decoder layers over a few dozen tokens, where every
norm, rotary embedding and activation is a kernel of its own. Replayed from a CUDA graph on an H200
its layers took 7.51 ms at 64 tokens, compiled per layer 3.86 ms (run 113,
``bench.probes.probe_outside_blocks --sections text-encoder``). In the benchmark, Z-Image-Turbo 512² in FP8
fast mode, the encode stage went from 11 to 7 ms and the call from 0.162 to 0.157 s (run 122), and the
warm start stayed at 5.5 s (``bench.warm_start``: the compile caches serve the parts too).

The layers are the classes the model itself names as its layers (transformers' ``_no_split_modules``
ending in ``DecoderLayer``, ``EncoderLayer`` or ``Block``: Qwen3's ``Qwen3DecoderLayer``, Qwen2.5-VL's
``Qwen2_5_VLDecoderLayer``, Mistral's ``MistralDecoderLayer``, CLIP's ``CLIPEncoderLayer``, T5's and UMT5's
``T5Block`` and ``UMT5Block``; vision layers are left alone). What compiles is each layer's parts (its
direct submodules: attention, feed-forward and the two norms; a T5 block's self-attention and feed-forward
layers, which it holds in a list), not the layer whole: transformers records
outputs (``output_attentions``) with forward hooks on the attention modules, which read a ``ContextVar``
that dynamo cannot trace. A hook on a compiled module runs around its compiled forward, eagerly, as it
would uncompiled; inside a compiled layer it broke the layer's graph into three, which took 4 s of dynamo
tracing in every warm start (H200, run 120). Only the two residual additions per layer stay eager kernels.

The parts compile like the transformer's blocks (:func:`~.compiled_blocks.compile_modules`: dynamic
shapes, so every trimmed prompt length shares one compile; parts of one class share one compile;
inductor's default mode; a compile that fails puts the eager forwards back for good, with a warning).

What the layers receive is decided outside them: the causal mask is built by an eager break
(:mod:`bcg_diffusion.patches.text_encoder`) and its decision (every token valid, hence no mask) is in the
runner's signature, so the warm-up call that compiles and the capture after it see the same mask, or the
same absence of one. A batch of prompts of different lengths gives the layers a mask: a second compiled
variant, made at that signature's warm-up.

Applies in fast mode to each text encoder that is accelerated (Z-Image's default components; others with
``components=``: ``"text_encoder"``, and FLUX.1's or SD3's ``"text_encoder_2"`` and ``"text_encoder_3"``,
each a feature instance of its own, :data:`TEXT_ENCODER_FEATURES`), and on a GPU only: on a CPU the compile
would cost seconds and gain nothing measured. Compiling changes rounding only, hence fast mode's; images stay byte-identical with and without graphs.
``choose(pipe.text_encoder, False)`` before ``accelerate`` keeps the eager layers (a shorter cold start).
``stats()`` reports ``text_encoder_compiles``, ``text_encoder_compile_seconds`` (the calls that compiled,
compiling included) and ``text_encoder_compile_failure``; for the other encoders, the same under their
component's name (``text_encoder_2_compiles``...). The T5, UMT5 and CLIP layers' compiles are tested on a
CPU; none is timed on a GPU yet, and FLUX.1's and Wan's pipelines leave their text encoders eager by
default.
"""

from __future__ import annotations

import logging

import torch

from .base import Setup
from .compiled_parts import CompiledParts, compile_defaults, set_choice

__all__ = [
    "COMPILED_TEXT_ENCODER",
    "TEXT_ENCODER_CHOICE",
    "TEXT_ENCODER_FEATURES",
    "CompiledTextEncoder",
    "choose",
    "decoder_layer_classes",
    "layer_parts",
]

logger = logging.getLogger(__name__)

COMPILED_TEXT_ENCODER = "text encoder layers compiled"  # its name in stats()["patches"]
# The attribute on a text encoder that keeps its layers eager in fast mode when False.
TEXT_ENCODER_CHOICE = "_bcg_compiled_text_encoder"


def choose(text_encoder: torch.nn.Module, compiled: bool) -> None:
    """Let fast mode compile ``text_encoder``'s decoder layers (``compiled=True``, the default) or keep
    them eager (False), before ``accelerate``.

    >>> choose(pipe.text_encoder, False)  # doctest: +SKIP

    Raises TypeError for anything but True or False.
    """
    set_choice(text_encoder, TEXT_ENCODER_CHOICE, compiled)


_LAYER_SUFFIXES = ("DecoderLayer", "EncoderLayer", "Block")


def decoder_layer_classes(model: torch.nn.Module) -> tuple[str, ...]:
    """The class names ``model`` (a transformers model) lists as its text layers: those of its
    ``_no_split_modules`` ending in one of ``DecoderLayer``, ``EncoderLayer`` or ``Block``, vision ones left
    out (empty: none, or not a transformers model)."""
    names = getattr(model, "_no_split_modules", None) or ()
    return tuple(name for name in names if name.endswith(_LAYER_SUFFIXES) and "Vision" not in name)


def layer_parts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every layer's parts (:func:`decoder_layer_classes`), with their names in ``model``: its direct
    submodules, and the modules of a list it holds in their place (T5's ``layer``); what
    :class:`CompiledTextEncoder` compiles."""
    classes = decoder_layer_classes(model)
    parts = []
    for name, layer in model.named_modules():
        if type(layer).__name__ not in classes:
            continue
        for part_name, part in layer.named_children():
            if isinstance(part, torch.nn.ModuleList | torch.nn.Sequential):
                parts += [(f"{name}.{part_name}.{index}", item) for index, item in enumerate(part)]
            else:
                parts.append((f"{name}.{part_name}", part))
    return parts


def _worth_compiling(model: torch.nn.Module) -> bool:
    """Whether compiling pays where ``model`` lives: on a GPU (the tests patch it to cover the CPU)."""
    return any(p.is_cuda for p in model.parameters())


class CompiledTextEncoder(CompiledParts):
    name = "compiled text encoder"
    component = "text_encoder"
    defaults = compile_defaults("text_encoder")
    choice = TEXT_ENCODER_CHOICE
    patch_name = COMPILED_TEXT_ENCODER

    def parts(self, setup: Setup, module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        if not _worth_compiling(module):
            return []
        parts = layer_parts(module)
        if not parts:
            logger.info("fast mode: %s names no decoder layers; its layers stay eager", type(module).__name__)
        return parts


class CompiledTextEncoder2(CompiledTextEncoder):
    name = "compiled text encoder 2"
    component = "text_encoder_2"  # FLUX.1's T5, SD3's second CLIP
    defaults = compile_defaults("text_encoder_2")
    patch_name = f"{COMPILED_TEXT_ENCODER} (text_encoder_2)"


class CompiledTextEncoder3(CompiledTextEncoder):
    name = "compiled text encoder 3"
    component = "text_encoder_3"  # SD3's T5
    defaults = compile_defaults("text_encoder_3")
    patch_name = f"{COMPILED_TEXT_ENCODER} (text_encoder_3)"


# One feature per text encoder a pipeline can hold (pipelines.base.PipelineAdapter.targets).
TEXT_ENCODER_FEATURES = (CompiledTextEncoder, CompiledTextEncoder2, CompiledTextEncoder3)
