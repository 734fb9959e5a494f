"""The modes a benchmark compares, each prepared on its own copy of the pipeline.

A copy shares every weight with the original (so four modes of a 20B model fit on one GPU) but has
its own module objects, so compiling or accelerating one copy never changes another.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.utils import BaseOutput

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.features import compiled_controlnet, compiled_text_encoder, fp8_attention, fused_qkv, vae_decoder
from bcg_diffusion.features.quantization import FP8, block_linears, quantize_transformer
from bcg_diffusion.features.step_caching import enable_cache
from bcg_diffusion.patches import block_glue, fp8_feed_forward, fp8_output_projection, stacked_output
from bcg_diffusion.patches.attention import choose_qk_prologue
from bcg_diffusion.pipelines import PipelineAdapter

from .catalog import (  # noqa: F401 - the names, re-exported for the modules that import them from here
    ABLATIONS,
    CACHED,
    CACHEDIT,
    CPU_DEFAULT_MODES,
    DEFAULT_MODES,
    DESCRIPTIONS,
    EXACT,
    FAST,
    FP8_MODES,
    MODES,
    OURS,
    SEPARATE,
    baseline,
)

logger = logging.getLogger(__name__)

WITHOUT_TEXT_ENCODER = ("transformer", "vae")
# -te: every text encoder named, so that those accelerate leaves eager by default (T5, UMT5, CLIP...) are captured
WITH_TEXT_ENCODERS = ("transformer", "transformer_2", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
# -no-controlnet: the denoisers and the VAE, not the ControlNet (captured by default)
WITHOUT_CONTROLNET = ("transformer", "transformer_2", "vae")


def _cloned(value: Any) -> Any:
    """Tensors in ``value`` (a tensor, tuple, list or diffusers output) cloned, the structure kept."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, BaseOutput):
        return type(value)(**{key: _cloned(item) for key, item in value.items()})
    if isinstance(value, (tuple, list)):
        return type(value)(_cloned(item) for item in value)
    return value


def _compile_with_own_graphs(transformer: torch.nn.Module) -> None:
    """The ``compile-max`` peer: the transformer's forward under ``torch.compile(mode="reduce-overhead")``,
    its outputs cloned outside the compiled code. Inductor's CUDA graphs reuse their output memory on
    the next call, and true CFG (Qwen-Image) reads the cond output after the uncond call; PyTorch's
    error for that says to clone outside ``torch.compile``, as a user would (our runner clones too)."""
    compiled = torch.compile(transformer.forward, mode="reduce-overhead")

    @functools.wraps(transformer.forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return _cloned(compiled(*args, **kwargs))

    transformer.forward = forward


def weight_sharing_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A structural copy of ``module`` whose parameters and buffers are the original tensors."""
    memo = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    return copy.deepcopy(module, memo)


def pipeline_copy(pipe: Any) -> Any:
    """A new pipeline of the same class sharing all weights, with its own transformer(s), ControlNet, VAE, text
    encoders and scheduler objects (the parts that modes patch or that hold per-call state), and the
    pipeline's own settings (``boundary_ratio`` of Wan 2.2...)."""
    components = dict(pipe.components)
    for name in PipelineAdapter.targets:  # every component a runner can hold, so a mode may patch it
        if components.get(name) is not None:
            components[name] = weight_sharing_copy(components[name])
    components["scheduler"] = copy.deepcopy(components["scheduler"])
    accepted = inspect.signature(type(pipe).__init__).parameters
    settings = {name: pipe.config[name] for name in accepted if name not in components and name in pipe.config}
    clone = type(pipe)(**components, **settings)
    clone.set_progress_bar_config(disable=True)
    return clone


@dataclass
class PreparedMode:
    name: str
    pipe: Any
    teardown: Callable[[], None]
    note: str = ""
    # A mode that is not byte-identical to eager names what it must equal instead: a context in
    # which the same pipeline runs that reference (fast mode: its compiled blocks without graphs).
    reference: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    reference_name: str = ""

    def state_check_seconds(self) -> float | None:
        """The time this mode's pipeline has spent checking the Python state its graphs read (None for
        modes that are not ours)."""
        return stats(self.pipe)["state_check_seconds"] if self.name in OURS else None

    def graph_stats(self) -> dict[str, Any]:
        if self.name not in OURS:
            return {}
        report = stats(self.pipe)
        keys = ("active", "captures", "replays", "eager_fallbacks", "misses", "graph_memory_bytes", "capture_seconds")
        keys += ("state_checks", "state_changes", "state_check_seconds", "invalidations", "evictions")
        keys += (
            ("compiles", "compile_seconds", "compiled_blocks", "cfg_batched", "cfg_batch_dropped")
            + ("vae_compiles", "vae_compile_seconds", "text_encoder_compiles", "text_encoder_compile_seconds")
            if self.name in FAST
            else ()
        )
        cached = self.name in CACHED or self.name in CACHEDIT
        keys += ("cache_states", "cache_branches", "cache_branch_switches") if cached else ()
        keys += ("quantized", "quantized_linears") if self.name in FP8_MODES else ()
        keys += ("fused_qkv",) if self.name in FP8_MODES and self.name in FAST else ()
        keys += ("attention", "fp8_attention_kernels") if parse(self.name).fp8_attention else ()
        keys += ("attention", "fa4_attention_modules") if parse(self.name).fa4_attention else ()
        out = {key: report[key] for key in keys}
        transformer = report.get("components", {}).get("transformer")
        if transformer is not None:  # graphs captured for the transformer, the cache's branch paths included
            out["transformer_captures"] = transformer["captures"] + report.get("cache_branches", 0)
        return out


# The modes that the options below modify: what is left of a mode's name once they are taken off
BASES = ("eager", "bcg", "bcg-no-te", "bcg-te", "bcg-no-auto", "fast", "fast-no-te", "fast-te", "fast-no-auto")
BASES += ("fast-unbatched",)
BASES += ("compile", "compile-max")


@dataclass(frozen=True)
class ModeOptions:
    """What a mode's name asks for: its base mode (one of :data:`BASES`) and the options its suffixes add."""

    base: str
    no_controlnet: bool = False  # -no-controlnet: the pipeline's ControlNet left eager
    cache: bool = False  # +cache: the step cache given by --cache
    cachedit: bool = False  # +cachedit: Cache-DiT's DBCache
    fp8: bool = False  # -fp8: the transformer's block linears in row-wise FP8
    fp8_attention: bool = False  # -attn: attention="fp8"
    fa4_attention: bool = False  # -fa4: attention="fa4"
    triton_attention: bool = False  # -triton (after -attn): our Triton FP8 attention kernel, not cuDNN's
    bf16_prologue: bool = False  # -bf16-prologue (after -attn): cuDNN's FP8 query and key quantized after the prologue
    inductor_prologue: bool = False  # -inductor-prologue: attention's prologue compiled by inductor, not our kernel
    torchao_feed_forward: bool = False  # -torchao-ff: our FP8 feed-forward kernel off
    unfused_qkv: bool = False  # -unfused-qkv: query, key and value projected apart
    uncompiled_text_encoder: bool = False  # -uncompiled-te: the text encoder's layers eager
    uncompiled_controlnet: bool = False  # -uncompiled-controlnet: the ControlNet's blocks eager
    compiled_vae: bool = False  # -compiled-vae: the VAE decoder compiled whole (an opt-in)
    patched_vae: bool = False  # -patched-vae: the VAE decoder contiguous, only its group norms patched
    inductor_glue: bool = False  # -inductor-glue: the FP8 block glue compiled by inductor
    joined_output: bool = False  # -joined-output: Qwen-Image's image output projection on its groups joined
    all_linears: bool = False  # -all-linears (after -fp8): every block linear in FP8, attention outputs too
    scaled_output: bool = False  # -scaled-output (after -attn): FP8 attention's output scaled back before to_out


def parse(name: str) -> ModeOptions:
    """The options of mode ``name``. Raises ValueError for a name that is not one of :data:`MODES`, or one
    whose suffixes leave something other than a base mode (a suffix this function does not know)."""
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; choose from {MODES}")
    rest = name
    options: dict[str, bool] = {}
    for suffix, option in (
        ("-no-controlnet", "no_controlnet"),
        ("+cache", "cache"),
        ("+cachedit", "cachedit"),
        ("-scaled-output", "scaled_output"),
        ("-bf16-prologue", "bf16_prologue"),
        ("-inductor-prologue", "inductor_prologue"),
        ("-triton", "triton_attention"),
        ("-attn", "fp8_attention"),
        ("-fa4", "fa4_attention"),
        ("-torchao-ff", "torchao_feed_forward"),
        ("-unfused-qkv", "unfused_qkv"),
        ("-uncompiled-te", "uncompiled_text_encoder"),
        ("-uncompiled-controlnet", "uncompiled_controlnet"),
        ("-compiled-vae", "compiled_vae"),
        ("-patched-vae", "patched_vae"),
        ("-inductor-glue", "inductor_glue"),
        ("-joined-output", "joined_output"),
        ("-all-linears", "all_linears"),
        ("-fp8", "fp8"),
    ):
        options[option] = rest.endswith(suffix)
        rest = rest.removesuffix(suffix)
    if rest not in BASES:
        raise ValueError(f"mode {name!r} leaves {rest!r} once its known options are taken off: not a base mode")
    return ModeOptions(rest, **options)


def prepare(
    name: str,
    base: Any,
    device: torch.device,
    cache: Callable[[], Any] | None = None,
    cachedit: Callable[[Any], dict[str, Any]] | None = None,
) -> PreparedMode:
    """Set up mode ``name`` on a fresh copy of ``base``; ``cache()`` gives the step cache config of the
    ``+cache`` modes (enabled on the copy before it is accelerated or compiled), ``cachedit(pipe)`` the
    ``cache_dit.enable_cache`` options of the ``+cachedit`` modes. Raises ValueError for an unknown mode, or
    a cached mode without its config."""
    options = parse(name)
    if options.cache and cache is None:
        raise ValueError(f"mode {name} needs a cache config")
    if options.cachedit and cachedit is None:
        raise ValueError(f"mode {name} needs Cache-DiT options")
    pipe = pipeline_copy(base)
    if options.cache:
        enable_cache(pipe, cache())  # before quantizing or accelerating, as a user would
    if options.cachedit:
        import cache_dit

        cache_dit.enable_cache(pipe, **cachedit(pipe))  # before accelerating, as a user would
    attention = "fp8" if options.fp8_attention else "fa4" if options.fa4_attention else None
    if options.torchao_feed_forward:
        fp8_feed_forward.choose(pipe.transformer, "torchao")  # the copy's modules: the other modes keep the default
    if options.triton_attention:
        fp8_attention.choose(pipe.transformer, "triton")
    if options.bf16_prologue:
        fp8_attention.choose_prologue(pipe.transformer, False)
    if options.inductor_prologue:
        choose_qk_prologue(pipe.transformer, "compiled")
    if options.unfused_qkv:
        fused_qkv.choose(pipe.transformer, False)
    if options.uncompiled_text_encoder and getattr(pipe, "text_encoder", None) is not None:
        compiled_text_encoder.choose(pipe.text_encoder, False)
    if (options.no_controlnet or options.uncompiled_controlnet) and getattr(pipe, "controlnet", None) is None:
        raise ValueError(f"{type(pipe).__name__} has no ControlNet for mode {name}")
    if options.uncompiled_controlnet:
        compiled_controlnet.choose(pipe.controlnet, False)
    if options.compiled_vae:
        vae_decoder.choose(pipe.vae, "compiled")
    if options.patched_vae:
        vae_decoder.choose(pipe.vae, "patched")
    if options.inductor_glue:
        block_glue.choose(pipe.transformer, False)
    if options.joined_output:
        stacked_output.choose(pipe.transformer, "joined")
    if options.scaled_output:
        fp8_output_projection.choose(pipe.transformer, "scaled")
    quantize = FP8 if options.fp8 else None
    quantize_filter = block_linears(pipe.transformer) if options.all_linears else None
    base_name = options.base
    if base_name == "eager" and quantize is not None:
        quantize_transformer(pipe.transformer, FP8, quantize_filter)
        quantize = quantize_filter = None
    fullgraph = name not in CACHED and name not in CACHEDIT
    mode = _prepare(
        base_name,
        pipe,
        device,
        fullgraph=fullgraph,
        quantize=quantize,
        quantize_filter=quantize_filter,
        attention=attention,
        no_controlnet=options.no_controlnet,
    )
    mode.name = name
    return mode


def _prepare(
    name: str,
    pipe: Any,
    device: torch.device,
    fullgraph: bool = True,
    quantize: Any = None,
    quantize_filter: Any = None,
    attention: str | None = None,
    no_controlnet: bool = False,
) -> PreparedMode:
    if name == "eager":
        return PreparedMode(name, pipe, lambda: None)
    debug = device.type != "cuda"
    note = "debug mode (CPU)" if debug else ""
    components = None  # accelerate's default
    if name.endswith("-no-te"):
        components = WITHOUT_TEXT_ENCODER
    elif name.endswith("-te"):
        components = WITH_TEXT_ENCODERS
    if no_controlnet:
        components = WITHOUT_CONTROLNET
    auto_breaks = not name.endswith("-no-auto")
    if name in ("bcg", "bcg-no-te", "bcg-te", "bcg-no-auto"):
        accelerate(
            pipe,
            components=components,
            debug=debug,
            quantize=quantize,
            quantize_filter=quantize_filter,
            auto_breaks=auto_breaks,
        )
        return PreparedMode(name, pipe, lambda: restore(pipe), note)
    if name in FAST:
        batch_cfg = False if name == "fast-unbatched" else None  # fast-unbatched+cache too (its base name)
        accelerate(
            pipe,
            mode="fast",
            components=components,
            debug=debug,
            batch_cfg=batch_cfg,
            quantize=quantize,
            quantize_filter=quantize_filter,
            attention=attention,
            auto_breaks=auto_breaks,
        )

        def teardown() -> None:
            restore(pipe)
            torch._dynamo.reset()  # the next case starts cold, like the compile peers

        return PreparedMode(
            name,
            pipe,
            teardown,
            note,
            reference=lambda: eager(pipe),
            reference_name="its compiled blocks without graphs",
        )
    if name == "compile":
        pipe.transformer.compile_repeated_blocks(fullgraph=fullgraph)
    else:
        _compile_with_own_graphs(pipe.transformer)

    def reset_dynamo() -> None:
        torch._dynamo.reset()  # drop compiled code and cudagraph trees before the next case

    return PreparedMode(name, pipe, reset_dynamo)
