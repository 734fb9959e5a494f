"""What an adapter tells the core about one family of diffusers pipelines."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import PIL.Image
import torch
from diffusers.models.attention_dispatch import _AttentionBackendRegistry

from ..core.hooks import MethodPatches
from ..features.cfg_batching import CfgBatchSpec
from ..patches import FunctionPatch, hunyuanimage
from ..patches.flux_attention import FLUX_ATTENTION_PATCHES
from ..patches.scoped import ProcessorPatch
from ..patches.wan_attention import WAN_ATTENTION_PATCH

__all__ = ["PipelineAdapter", "WarmupRequest", "attention_backend_key", "vae_layout_key"]


# The components whose attention goes through diffusers' dispatcher, and so through its active backend: every
# denoiser (a second expert and a ControlNet too, which once replayed another backend's graphs).
_DISPATCHING_COMPONENTS = ("transformer", "transformer_2", "controlnet")


def attention_backend_key() -> Hashable:
    """The globally active diffusers attention backend: changing it changes the kernels a forward runs.

    Called on every call of a denoiser (it is part of the signature), so it returns the backend enum as is.
    """
    return _AttentionBackendRegistry.get_active_backend()[0]


def vae_layout_key(vae: Any) -> Callable[[], Hashable]:
    """Tiling and slicing switch the VAE's decode between code paths, so they key its graphs."""

    def key() -> Hashable:
        return (getattr(vae, "use_tiling", False), getattr(vae, "use_slicing", False))

    return key


@dataclass(frozen=True)
class WarmupRequest:
    """What one warm-up step asks an adapter for: calls at ``width`` x ``height`` with CFG on or off,
    one per prompt in ``prompts``, under the pipeline's ``text_buckets`` (None: exact); ``call_kwargs``
    are what the caller passes to every call on top (e.g. ``max_sequence_length``, ``negative_prompt``)."""

    width: int
    height: int
    cfg: bool
    prompts: Sequence[str]
    text_buckets: tuple[int, ...] | None = None
    call_kwargs: Mapping[str, Any] = field(default_factory=dict)


def image_inputs(pipe: Any, request: WarmupRequest) -> dict[str, Any]:
    """What an img2img, inpaint or ControlNet relative needs on top of a text-to-image call, for a warm-up at
    the request's size: a grey ``image`` (``strength`` 1.0, so every warm-up step runs the transformer) and,
    for inpainting, a ``mask_image`` over its left half; for a ControlNet, what :func:`_control_inputs` gives.
    Their signatures are the serving calls' at that size: the transformer and the ControlNet see tensors of
    the same shapes, and the VAE's ``encode`` of an image is not accelerated. What ``request.call_kwargs``
    gives is not replaced; nothing for pipelines that take no image."""
    parameters = inspect.signature(type(pipe).__call__).parameters
    inputs: dict[str, Any] = {}
    if "image" in parameters and not any(key in request.call_kwargs for key in ("image", "mask_image")):
        inputs["image"] = _grey_image(request)
        if "strength" in parameters:
            inputs["strength"] = 1.0
        if "mask_image" in parameters:
            inputs["mask_image"] = _left_half_mask(request)
    if "control_image" in parameters and "control_image" not in request.call_kwargs:
        given = set(request.call_kwargs)
        inputs.update(
            (key, value) for key, value in _control_inputs(pipe, request, parameters).items() if key not in given
        )
    return inputs


def _control_inputs(pipe: Any, request: WarmupRequest, parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A ControlNet pipeline's warm-up inputs, of those its ``__call__`` takes (``parameters``): a grey ``control_image`` (one per
    ControlNet of a wrapper of several, each at ``controlnet_conditioning_scale`` 1.0, which FLUX.1's pipeline
    takes only as a list there), ``control_mask`` for ControlNet inpainting (Qwen-Image's, SD3's: the left
    half), and ``control_mode`` 0 for a union ControlNet (FLUX.1's, whose forward refuses a call without one; the
    mode reaches the graphs as a tensor, so any mode replays them)."""
    controlnet = getattr(pipe, "controlnet", None)
    nets = getattr(controlnet, "nets", None)
    grey = _grey_image(request)
    inputs: dict[str, Any] = {"control_image": grey if nets is None else [grey] * len(nets)}
    if nets is not None and "controlnet_conditioning_scale" in parameters:
        inputs["controlnet_conditioning_scale"] = [1.0] * len(nets)
    if "control_mask" in parameters:
        inputs["control_mask"] = _left_half_mask(request)
    if "control_mode" in parameters and any(getattr(net, "union", False) is True for net in nets or [controlnet]):
        inputs["control_mode"] = 0
    return inputs


def _grey_image(request: WarmupRequest) -> PIL.Image.Image:
    return PIL.Image.new("RGB", (request.width, request.height), (128, 128, 128))


def _left_half_mask(request: WarmupRequest) -> PIL.Image.Image:
    mask = PIL.Image.new("L", (request.width, request.height), 0)
    mask.paste(255, (0, 0, request.width // 2, request.height))
    return mask


class PipelineAdapter:
    """Base adapter: which components become graphs, which patches they need, what else keys them.

    Subclasses set ``name``, ``class_prefixes`` (pipeline class names they serve, matched as prefixes
    along the MRO) and ``tested_classes``, and add ``patches`` where a graph-hostile op has an exact
    device-side equivalent. Scheduler steps, CFG arithmetic and pipeline Python stay eager: only the
    methods named in ``targets`` are replaced. ``fast_patches`` apply in fast mode only.
    """

    name: str = "generic"
    class_prefixes: tuple[str, ...] = ()
    tested_classes: tuple[str, ...] = ()
    # transformer_2: the second expert of two-expert pipelines (Wan 2.2), graphs of its own forward
    targets: dict[str, str] = {
        "transformer": "forward",
        "transformer_2": "forward",
        "controlnet": "forward",  # a ControlNet called beside the transformer each step (FLUX.1's, SD3's...)
        "vae": "decode",
        "text_encoder": "forward",
        "text_encoder_2": "forward",  # FLUX.1's T5, SD3's second CLIP
        "text_encoder_3": "forward",  # SD3's T5
    }
    # What ``components=None`` accelerates: the components this family was measured faster with. A text encoder
    # among them is taken only if its class is in ``default_text_encoders``. A ControlNet's forward as graphs took
    # FLUX.1 with a six-block ControlNet 3-8% faster at 512² (two hosts) and 1% at 1024², exact and fast (runs 221,
    # 223, H100).
    default_components: tuple[str, ...] = (
        "transformer", "transformer_2", "controlnet", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"
    )  # fmt: skip
    # Text encoders captured by default, by class: those measured faster as graphs (and byte-equal to eager) whose
    # prompts the pipelines pad to one length, so one capture serves every prompt. Qwen3-4B: 44-65 ms eager, 17 ms
    # replayed, 11 ms in fast mode (Z-Image, runs 12, 29, 44; on FLUX.2 klein, the same model, 5.5% / 8.7% of a call
    # in exact / fast mode, run 185). T5, UMT5, CLIP and the others stay eager unless named in ``components=``: FLUX.1's
    # CLIP and T5-XXL captured gained 0.15% / 0.05% (run 185, ``python -m bench --text-encoders``), their encode being
    # GPU work at 512 tokens, not launches.
    default_text_encoders: tuple[str, ...] = ("Qwen3Model", "Qwen3ForCausalLM")
    patches: tuple[FunctionPatch, ...] = ()
    # Forwards the runner calls instead of a model's own, byte-identical and capturable where the original is not:
    # each takes the bound method and gives it back unchanged unless it is the one it replaces.
    forward_replacements: tuple[Callable[[Callable[..., Any]], Callable[..., Any]], ...] = (
        hunyuanimage.runner_forward,
    )
    # Fast mode only: patches that compile better but round differently, scoped to the accelerated model. Each
    # applies to the processors of its class wherever they are: FLUX.1's and FLUX.2's, and Wan's under cuDNN's
    # FP8 attention, for any pipeline.
    fast_patches: tuple[ProcessorPatch, ...] = (*FLUX_ATTENTION_PATCHES, WAN_ATTENTION_PATCH)
    # Fast mode: how the transformer's cond and uncond calls of a step batch (None: they do not), and the
    # pipeline classes whose calls were checked to fit it (None: the tested classes).
    cfg_batch: CfgBatchSpec | None = None
    cfg_batch_classes: tuple[str, ...] | None = None
    # Fast mode: run the pipeline's causal text encoder on a prompt's tokens rounded up to this
    # multiple instead of all the padding the pipeline adds (None: as called; see text_trim).
    text_trim_multiple: int | None = None
    # Warm-up calls: the keyword that switches CFG on and off, and its two values.
    guidance_argument: str = "guidance_scale"
    guidance_values: tuple[float, float] = (1.0, 4.0)  # (no CFG, CFG)

    def matches(self, pipe: Any) -> bool:
        return (
            any(cls.__name__.startswith(self.class_prefixes) for cls in type(pipe).__mro__)
            if self.class_prefixes
            else False
        )

    def is_tested(self, pipe: Any) -> bool:
        return type(pipe).__name__ in self.tested_classes

    def batches_cfg(self, pipe: Any) -> bool:
        """Whether fast mode batches ``pipe``'s cond and uncond transformer calls (:attr:`cfg_batch`)."""
        classes = self.tested_classes if self.cfg_batch_classes is None else self.cfg_batch_classes
        return self.cfg_batch is not None and type(pipe).__name__ in classes

    def runner_callable(self, component: str, method: Callable[..., Any]) -> Callable[..., Any]:
        """What the runner of ``component`` calls: ``method`` itself, or what one of :attr:`forward_replacements`
        gives for it; for a text encoder, ``method`` called with ``use_cache=False`` (a key/value cache object is
        not a tensor output a graph can return, and encoding a prompt once never reads it)."""
        if not component.startswith("text_encoder"):
            for replacement in self.forward_replacements:
                method = replacement(method)
            return method

        @functools.wraps(method)
        def without_cache(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("use_cache", False)
            return method(*args, **kwargs)

        return without_cache

    def call_key(self, component: str) -> Callable[[tuple, dict], Hashable] | None:
        """A decision about a call's values that picks a code path, made eagerly and put in the
        signature (None: shapes say everything). For a text encoder: whether every token is valid, which
        decides whether transformers builds an attention mask at all."""
        if not component.startswith("text_encoder"):
            return None

        def all_tokens_valid(args: tuple, kwargs: dict) -> bool:
            mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)  # forward(input_ids, mask)
            return mask is None or bool(mask.all())  # a host sync, once per prompt encoding

        return all_tokens_valid

    def install_module(self, component: str, module: torch.nn.Module, patches: MethodPatches) -> None:
        """Instance patches this family needs on one component's module, recorded in ``patches`` so that
        ``restore`` undoes them (none by default). Called once per module, when it is first accelerated."""

    def prepare_call(self, component: str) -> Callable[[tuple, dict], tuple[tuple, dict]] | None:
        """Eager preparation of a call's ``(args, kwargs)`` before its signature is taken, e.g. padding
        to a bucket whose graph serves the call exactly (None: calls go in as they are). What it returns
        is what ``runner_callable``'s function receives, captured or not."""
        return None

    def install_text_buckets(self, pipe: Any, buckets: tuple[int, ...], patches: MethodPatches) -> None:
        """Pad prompts to ``buckets`` (see :mod:`bcg_diffusion.features.text_buckets`). Raises ValueError where the
        model's own padding would make that change the image."""
        raise ValueError(f"text buckets are not supported for the {self.name} adapter (Qwen-Image only)")

    def warmup_calls(self, pipe: Any, request: WarmupRequest) -> list[dict[str, Any]]:
        """Keyword arguments of the warm-up calls for one resolution and CFG mode: one per prompt."""
        return [
            {**self.warmup_kwargs(request.width, request.height, request.cfg, prompt), **image_inputs(pipe, request)}
            for prompt in request.prompts
        ]

    def text_encoder_warmup_calls(
        self, pipe: Any, call_kwargs: Mapping[str, Any], multiple: int
    ) -> list[dict[str, Any]]:
        """Keyword arguments of direct text-encoder calls, one per ``multiple``-token bucket, that
        capture what fast mode's trimmed encoder (:mod:`bcg_diffusion.features.text_trimming`) will run (none by
        default: only pipelines that pad prompts for a causal encoder trim)."""
        return []

    def embeddings_call(self, pipe: Any, request: WarmupRequest) -> tuple[dict[str, Any], torch.dtype]:
        """A warm-up call's arguments without prompt text (the caller adds embeddings), and the dtype
        the pipeline's own prompt embeddings have (its text encoder's, else its transformer's)."""
        kwargs = {**self.warmup_kwargs(request.width, request.height, request.cfg, ""), **image_inputs(pipe, request)}
        del kwargs["prompt"]
        kwargs.pop("negative_prompt", None)
        text_encoder = getattr(pipe, "text_encoder", None)
        return kwargs, (text_encoder if text_encoder is not None else pipe.transformer).dtype

    def warmup_kwargs(self, width: int, height: int, cfg: bool, prompt: str) -> dict[str, Any]:
        """Pipeline arguments of one warm-up call: every signature a normal call at this resolution
        and CFG mode needs (transformer per step, VAE decode) with two denoising steps."""
        kwargs = {
            "prompt": prompt,
            "width": width,
            "height": height,
            "num_inference_steps": 2,
            "output_type": "pil",
            self.guidance_argument: self.guidance_values[cfg],
        }
        if cfg:
            kwargs["negative_prompt"] = " "
        return kwargs

    def state_key(self, component: str, module: Any) -> Callable[[], Hashable] | None:
        """Extra signature state for ``component`` (None: its arguments say everything)."""
        if component in _DISPATCHING_COMPONENTS:
            return attention_backend_key
        if component == "vae":
            return vae_layout_key(module)
        return None
