"""Options of :func:`bcg_diffusion.accelerate`, validated when they are made, not deep inside a call."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["TEXT_ENCODERS", "AccelerateConfig", "describe_changes", "validate_buckets"]

_MODES = ("exact", "fast")
_CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
_ATTENTION_KERNELS = ("fp8", "fa4")
# A pipeline's text encoders by the names diffusers gives them (FLUX.1: CLIP, then T5; SD3: two CLIPs, then T5)
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
_KNOWN_COMPONENTS = ("transformer", "transformer_2", "controlnet", "vae", *TEXT_ENCODERS)
RESOLUTION_MULTIPLE = 16  # Qwen-Image and Z-Image: the VAE's 8x down-sampling, then the transformer's 2x2 patches
_MAX_VALUE_CHARS = 60  # of one value's repr in describe_changes: a torchao config or a function stays short


@dataclass(frozen=True)
class AccelerateConfig:
    """How :func:`~bcg_diffusion.accelerate` patches a pipeline.

    Attributes:
        mode: ``"exact"``: replayed graphs of the eager kernels, byte-identical to eager.
            ``"fast"``: the transformer's repeated blocks are compiled by inductor (no CUDA graphs of
            its own) and the whole forward, compiled blocks included, is captured as breakable graphs.
            Byte-identical to the same compiled blocks run without graphs (``with eager(pipe):``), not
            to eager: compiled kernels round differently (see the README for measured differences).
        debug: run the whole runner path (signatures, static buffers, copies, output clones, counters)
            without CUDA graphs, on any device, the CPU included. Each signature's forward is recorded
            once and replayed from its record (:mod:`bcg_diffusion.core.recording`): Python values are
            baked in as a graph bakes them, so debug mode goes stale exactly where a GPU would.
            ``"verify"``: the same, and every replay is also compared with the eager forward; a difference
            warns (:class:`BCGWarning`), naming the first operation that differs and its source line,
            and is counted in ``stats()["mismatches"]``. The tool to ask "is my model safe to graph?".
        components: which pipeline components to run as graphs: ``"transformer"`` (its forward),
            ``"transformer_2"`` (the second expert of two-expert pipelines such as Wan 2.2), ``"vae"`` (its
            ``decode``), ``"text_encoder"`` (its forward; built for Z-Image's Qwen3 encoder, whose prompts
            are always padded to 512 tokens: one capture serves every prompt; byte-equal to eager on an
            H200), ``"text_encoder_2"``, ``"text_encoder_3"`` (the pipeline's other text encoders:
            FLUX.1's T5, SD3's), and ``"controlnet"`` (a ControlNet's forward, or several ControlNets'
            wrapper's; one ControlNet's conditioning scale is applied after its graphs, so every scale replays
            one capture; several ControlNets' list of scales keys graphs of its own). None (default): what
            the pipeline's adapter was measured faster with, byte-equal to eager:
            transformer (and a second expert), VAE, a ControlNet (FLUX.1's, SD3's, Sana's, Qwen-Image's; not
            Z-Image's, which shares the transformer's modules; in fast mode its blocks compile) and a Qwen3 text
            encoder (Z-Image's, FLUX.2 klein's: every prompt padded to 512 tokens); other encoders (T5, UMT5,
            CLIP, Qwen-Image's Qwen2.5-VL...) stay eager unless named here.
        warmup_runs: eager runs on the capture stream before each capture (cuBLAS workspaces,
            lazily built caches such as RoPE tables). At least 1.
        capture_error_mode: ``cudaStreamCaptureMode`` for captures: ``"thread_local"`` (default)
            lets other threads keep using CUDA while one captures; ``"global"`` is strictest.
        track_external_tensors: keep alive every tensor created outside a capture that the graph
            reads (see :mod:`bcg_diffusion.core.graphs`). Turn off only if you hold them yourself.
        compile_cache_dir: ``mode="fast"`` only: where PyTorch keeps its compile caches (inductor, AOT
            autograd, Triton; it sets ``TORCHINDUCTOR_CACHE_DIR`` for the process) and where we keep a
            portable copy of them, so a later process (on this or another machine) starts warm. None:
            PyTorch's default directory, which already makes later processes on this machine warm.
        text_buckets: Qwen-Image only: pad prompt embeddings and mask to the next of these token
            lengths (e.g. ``(64, 128, 256, 512)``), so one capture serves every prompt up to a bucket.
            Not byte-identical to the unpadded call (the masked attention path rounds differently; see
            :mod:`bcg_diffusion.features.text_buckets`). None (default): exact, no padding. Z-Image needs none:
            its captions are bucketed exactly to multiples of 32 tokens (:mod:`bcg_diffusion.patches.zimage`).
        max_signatures: at most this many captured signatures per pipeline (all components together);
            capturing one more first evicts the one replayed longest ago, whose graph memory returns to
            the shared pool. None: no limit.
        warmup: resolutions ``(width, height)`` to capture when :func:`~bcg_diffusion.accelerate`
            returns, by calling the pipeline once per resolution and CFG mode (see
            :func:`~bcg_diffusion.warm_up`, which also warms up later). Both sides positive multiples of 16
            (Qwen-Image and Z-Image: the VAE's 8x down-sampling, then 2x2 patches); ValueError otherwise.
        warmup_cfg: the CFG modes to warm up: ``False`` (no CFG) and/or ``True`` (CFG).
        lazy_capture: capture a signature the first time a call needs it (single-user use). Turn off
            for serving after a warm-up: a call of a signature never captured then runs eagerly (counted
            in ``stats()["misses"]`` and logged once with what differs from the nearest captured one),
            so no request waits for a capture.
        batch_cfg: ``mode="fast"`` only: run true CFG's cond and uncond transformer calls of a step
            as one batch (Qwen-Image's pipeline; see :mod:`bcg_diffusion.features.cfg_batching`), which reads the
            weights once for both. ``None`` (default): on in fast mode for the pipelines that support
            it; ``False``: off. Its rounding is part of fast mode's, so ``with eager(pipe):`` batches too.
        quantize: ``"fp8"``: quantize the transformer's repeated blocks with torchao's row-wise FP8
            (dynamic activations, needs compute capability 8.9 or more and ``bcg-diffusion[fp8]``),
            before capture; or any torchao config object, applied the same way. Exact mode then
            equals the same quantized model run eagerly; ``restore`` gives the original weights back.
            See :mod:`bcg_diffusion.features.quantization`. None (default): the weights as they are (a model the
            user quantized with torchao beforehand is captured as it is).
        quantize_filter: which linears ``quantize`` quantizes, as torchao's ``filter_fn(module, name)``;
            None: :func:`bcg_diffusion.features.quantization.default_filter`.
        attention: ``mode="fast"`` only. ``"fp8"``: the transformer's attention runs in FP8 (query, key,
            value and probabilities in float8 e4m3, our Triton kernel; needs a CUDA GPU of compute
            capability 8.9 or newer and Triton), an opt-in that changes the image more than FP8
            linears do (see ``docs/quantization.md``). ``"fa4"``: attention in the model's dtype
            through FlashAttention-4 (the ``flash-attn-4`` package; a GPU of compute capability 9.x
            or 10.x), faster than cuDNN's kernel on Hopper, same precision. None (default): PyTorch's
            attention in the model's dtype (cuDNN's kernel on Hopper), with or without ``quantize``.
            See :mod:`bcg_diffusion.features.fp8_attention` and :mod:`bcg_diffusion.features.fa4_attention`.
        auto_breaks: make every operation a capture cannot hold (host syncs, data-dependent shapes,
            copies from pageable host memory) an eager break of its own, checked on replay like a
            marked one, and retry a failed capture once with what it taught
            (:mod:`bcg_diffusion.core.auto_breaks`). Each is listed in
            ``stats()["signatures"][i]["auto_breaks"]``. False: such a capture fails and its
            signature runs eagerly, with the reason. Needs ``track_external_tensors``.
        cfg_parallel: under ``torchrun`` with two ranks, ``True`` (the default process group) or a
            process group of two: each true-CFG step's cond call runs on rank 0 and its uncond call on
            rank 1, with one exchange of the predictions per step; designed to give one GPU's bytes (checked with
            gloo on CPUs; no GPU run yet)
            (:mod:`bcg_diffusion.features.cfg_parallel`). Every rank makes the same pipeline calls. Under context
            parallelism, the group of two ranks from different context-parallel groups
            (``mesh["cfg"].get_group()``; ``True`` is refused).
    """

    mode: str = "exact"
    debug: bool | str = False
    components: tuple[str, ...] | None = None
    warmup_runs: int = 2
    capture_error_mode: str = "thread_local"
    track_external_tensors: bool = True
    compile_cache_dir: str | None = None
    text_buckets: tuple[int, ...] | None = None
    max_signatures: int | None = None
    warmup: tuple[tuple[int, int], ...] = ()
    warmup_cfg: tuple[bool, ...] = (False, True)
    lazy_capture: bool = True
    batch_cfg: bool | None = None
    quantize: Any = None
    quantize_filter: Any = None
    attention: str | None = None
    auto_breaks: bool = True
    cfg_parallel: Any = False

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or self.mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {self.mode!r}")
        if isinstance(self.debug, str) and self.debug != "verify":
            raise ValueError(f'debug must be True, False or "verify", got {self.debug!r}')
        if not isinstance(self.debug, (bool, str)):
            raise TypeError(f'debug must be a bool or "verify", got {type(self.debug).__name__}')
        for name in ("track_external_tensors", "lazy_capture", "auto_breaks"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.cfg_parallel, bool) and not hasattr(self.cfg_parallel, "size"):
            raise TypeError(f"cfg_parallel must be a bool or a process group, got {type(self.cfg_parallel).__name__}")
        if self.components is not None:
            object.__setattr__(self, "components", component_names(self.components))
        if isinstance(self.warmup_runs, bool) or not isinstance(self.warmup_runs, int):
            raise TypeError(f"warmup_runs must be an int, got {type(self.warmup_runs).__name__}")
        if not 1 <= self.warmup_runs <= 10:
            raise ValueError(f"warmup_runs must be between 1 and 10, got {self.warmup_runs}")
        if self.batch_cfg is not None and not isinstance(self.batch_cfg, bool):
            raise TypeError(f"batch_cfg must be a bool or None, got {type(self.batch_cfg).__name__}")
        if self.batch_cfg and self.mode != "fast":
            raise ValueError("batch_cfg applies to mode='fast' only (batching changes rounding; exact mode is exact)")
        if self.compile_cache_dir is not None:
            if not isinstance(self.compile_cache_dir, (str, os.PathLike)):
                raise TypeError(f"compile_cache_dir must be a path, got {type(self.compile_cache_dir).__name__}")
            if self.mode != "fast":
                raise ValueError("compile_cache_dir applies to mode='fast' only (exact mode compiles nothing)")
            object.__setattr__(self, "compile_cache_dir", os.fspath(self.compile_cache_dir))
        if self.max_signatures is not None:
            if isinstance(self.max_signatures, bool) or not isinstance(self.max_signatures, int):
                raise TypeError(f"max_signatures must be an int or None, got {type(self.max_signatures).__name__}")
            if self.max_signatures < 1:
                raise ValueError(f"max_signatures must be at least 1, got {self.max_signatures}")
        if self.text_buckets is not None:
            object.__setattr__(self, "text_buckets", validate_buckets(self.text_buckets))
        object.__setattr__(self, "warmup", resolution_pairs(self.warmup))
        cfg_modes = self.warmup_cfg
        if isinstance(cfg_modes, bool) or not isinstance(cfg_modes, (tuple, list)):
            raise TypeError(f"warmup_cfg must be a tuple of bools such as (False, True), got {cfg_modes!r}")
        if not cfg_modes or not all(isinstance(c, bool) for c in cfg_modes):
            raise ValueError(f"warmup_cfg must name at least one CFG mode (False and/or True), got {cfg_modes!r}")
        object.__setattr__(self, "warmup_cfg", tuple(dict.fromkeys(cfg_modes)))
        if self.quantize is not None and self.quantize != "fp8" and not _is_torchao_config(self.quantize):
            raise ValueError(f'quantize must be "fp8", a torchao config object or None, got {self.quantize!r}')
        if self.quantize_filter is not None:
            if self.quantize is None:
                raise ValueError("quantize_filter applies with quantize= only")
            if not callable(self.quantize_filter):
                raise TypeError(
                    f"quantize_filter must be callable (module, name) -> bool, got {self.quantize_filter!r}"
                )
        if self.attention is not None:
            if self.attention not in _ATTENTION_KERNELS:
                raise ValueError(f"attention must be one of {_ATTENTION_KERNELS} or None, got {self.attention!r}")
            if self.mode != "fast":
                raise ValueError(
                    f"attention={self.attention!r} applies to mode='fast' only (it changes rounding; exact mode is exact)"
                )
        if self.capture_error_mode not in _CAPTURE_ERROR_MODES:
            raise ValueError(
                f"capture_error_mode must be one of {_CAPTURE_ERROR_MODES}, got {self.capture_error_mode!r}"
            )

    @classmethod
    def from_options(cls, config: AccelerateConfig | None, options: dict[str, Any]) -> AccelerateConfig:
        """``config`` (or the defaults) with ``options`` applied on top; unknown option names raise TypeError."""
        if config is not None and not isinstance(config, cls):
            raise TypeError(f"config must be an AccelerateConfig, got {type(config).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; valid options are {sorted(names)}")
        values = {f.name: getattr(config, f.name) for f in fields(cls)} if config is not None else {}
        values.update(options)
        return cls(**values)


def _is_torchao_config(value: Any) -> bool:
    """Whether ``value`` is a torchao quantization config (checked by class, without importing torchao)."""
    return any(cls.__name__ == "AOBaseConfig" and cls.__module__.startswith("torchao") for cls in type(value).__mro__)


def component_names(value: Any) -> tuple[str, ...]:
    """``value`` (one name or a sequence of names) as a tuple of known component names, duplicates
    dropped. Raises TypeError for anything but strings, ValueError for an unknown name or none."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not all(isinstance(c, str) for c in value):
        raise TypeError(f"components must be a tuple of strings, got {value!r}")
    unknown = [c for c in value if c not in _KNOWN_COMPONENTS]
    if unknown:
        raise ValueError(f"unknown components {unknown}; choose from {_KNOWN_COMPONENTS}")
    if not value:
        raise ValueError("components is empty: nothing would be accelerated")
    return tuple(dict.fromkeys(value))


def describe_changes(old: AccelerateConfig, new: AccelerateConfig) -> str:
    """The options where ``new`` differs from ``old``, in field order, as ``"mode: 'exact' → 'fast', debug:
    False → True"`` (each value's repr, shortened past 60 characters); ``"no option differs"`` when none does."""
    changes = [
        f"{f.name}: {_short_repr(getattr(old, f.name))} → {_short_repr(getattr(new, f.name))}"
        for f in fields(AccelerateConfig)
        if getattr(old, f.name) != getattr(new, f.name)
    ]
    return ", ".join(changes) or "no option differs"


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 3] + "..."


def resolution_pairs(value: Any) -> tuple[tuple[int, int], ...]:
    """``[(1024, 1024), (512, 768)]`` as a tuple of distinct ``(width, height)`` pairs of ints.

    Raises TypeError for anything but pairs of ints, ValueError for a side that is not a positive multiple of
    16: Qwen-Image's and Z-Image's pipelines need that (the VAE's 8x down-sampling, then 2x2 patches), and a
    warm-up at another size would fail inside diffusers or capture a size no call uses."""
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"warmup must be a list of (width, height) pairs, got {value!r}")
    pairs = []
    for item in value:
        if (
            not isinstance(item, (tuple, list))
            or len(item) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)
        ):
            raise TypeError(f"warmup entries must be (width, height) pairs of ints, got {item!r}")
        pair = (item[0], item[1])
        if min(pair) <= 0:
            raise ValueError(f"warmup resolution {pair!r} must be positive")
        if pair[0] % RESOLUTION_MULTIPLE or pair[1] % RESOLUTION_MULTIPLE:
            nearest = tuple(
                max(RESOLUTION_MULTIPLE, round(side / RESOLUTION_MULTIPLE) * RESOLUTION_MULTIPLE) for side in pair
            )
            raise ValueError(
                f"warmup resolution {pair!r}: width and height must be multiples of {RESOLUTION_MULTIPLE} (the VAE's "
                f"8x down-sampling, then the transformer's 2x2 patches); try {nearest!r}"
            )
        pairs.append(pair)
    return tuple(dict.fromkeys(pairs))


def validate_buckets(buckets: Any) -> tuple[int, ...]:
    """Sorted, distinct positive ints. Raises TypeError / ValueError naming what is wrong."""
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, (tuple, list)):
        raise TypeError(f"text_buckets must be a tuple of token lengths such as (64, 128, 256, 512), got {buckets!r}")
    if not buckets:
        raise ValueError("text_buckets is empty: give at least one token length, or None for exact mode")
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in buckets):
        raise TypeError(f"text_buckets must hold ints, got {buckets!r}")
    if min(buckets) <= 0:
        raise ValueError(f"text_buckets must be positive, got {buckets!r}")
    return tuple(sorted(set(buckets)))
