"""The code of diffusers (and Cache-DiT) under each patch, checked before the patch is installed.

A patch that replaces, mirrors or re-implements a dependency's code is right only for the code it was written
against: our ``compute_text_seq_len_from_mask`` is diffusers' with one copy made on the device; fast mode's
attention processors re-implement diffusers' ones; the fused block paths inline a block's forward; the step
caches mirror how diffusers' cache hooks decide; the Cache-DiT carrier relies on how Cache-DiT's blocks call
its state. A diffusers release that changes such code would leave the patch running the old arithmetic, and
the accelerated images would part from eager ones with no warning.

So each patch names, in :data:`FOLLOWED`, every function whose code it depends on, with a digest of that
code's source as the tested versions (:data:`TESTED`) have it: the first 16 hex digits of the SHA-256 of
``inspect.getsource``. :func:`installable` compares the installed code with them when the patch would be
installed. On a difference the patch is not installed: the component keeps its graphs without it, or runs
eagerly where it cannot do without it, and one :class:`~bcg_diffusion.BCGWarning` names the patch, the
function and the installed version. A comment or a docstring changed counts as a change: a digest cannot
tell. ``tests/test_followed.py`` checks every digest against the installed packages, and plants a changed
function under each kind of patch.

Not here: patches that call the installed code rather than mirror it (transformers' ``create_causal_mask``
and diffusers' collectives, made eager breaks: they follow whatever is installed), and the pipelines'
``__call__`` code the adapters rely on (how a pipeline calls its transformer), whose changes the runner's
signatures and state checks see.

>>> installable("qwenimage.compute_text_seq_len_from_mask")   # doctest: +SKIP
True
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import inspect
import logging
import operator
import sys
import types
import warnings
import weakref
from typing import Any

__all__ = ["FOLLOWED", "TESTED", "changed", "digest", "installable", "resolve"]

logger = logging.getLogger(__name__)

# The versions whose code the digests below are of (checked by tests/test_followed.py and on the GPU machine).
TESTED = {"diffusers": ("0.42.0", "0.42.1"), "cache-dit": ("1.5.3",)}

_QI = "diffusers.models.transformers.transformer_qwenimage"
_ZI = "diffusers.models.transformers.transformer_z_image"
_FLUX = "diffusers.models.transformers.transformer_flux"
_FLUX2 = "diffusers.models.transformers.transformer_flux2"
_ROTARY = "diffusers.models.embeddings.apply_rotary_emb"
_RMS_NORM = "diffusers.models.normalization.RMSNorm.forward"
_DISPATCH = "diffusers.models.attention_dispatch.dispatch_attention_fn"
_QWEN_PROCESSOR = f"{_QI}.QwenDoubleStreamAttnProcessor2_0.__call__"
_Z_PROCESSOR = f"{_ZI}.ZSingleStreamAttnProcessor.__call__"
_GELU = ("diffusers.models.activations.GELU.forward", "diffusers.models.activations.GELU.gelu")
_FLUX_FEED_FORWARD = "diffusers.models.attention.FeedForward.forward"
_Z_FEED_FORWARD = (f"{_ZI}.FeedForward.forward", f"{_ZI}.FeedForward._forward_silu_gating")
_HOOKS = "diffusers.hooks"
_WAN_VAE = "diffusers.models.autoencoders.autoencoder_kl_wan"
_QWEN_VAE = "diffusers.models.autoencoders.autoencoder_kl_qwenimage"
_CACHE_DIT = "cache_dit.caching"
_CONTROLNETS = "diffusers.models.controlnets"

# patch name -> {dotted path of a function it depends on: its digest in the tested versions}
FOLLOWED: dict[str, dict[str, str]] = {
    # function patch (both modes): a copy of diffusers' function, one host copy made on the device
    "qwenimage.compute_text_seq_len_from_mask": {f"{_QI}.compute_text_seq_len_from_mask": "7df03db69ecf3bef"},
    # fast mode's processor patches: diffusers' processors with their arithmetic rearranged
    "qwenimage.apply_rotary_emb_qwen (real arithmetic)": {
        _QWEN_PROCESSOR: "e6dfad13458f15b3",
        f"{_QI}.apply_rotary_emb_qwen": "62c3cf93c5e4d4eb",
    },
    "qwenimage attention (per prompt in a CFG batch)": {
        _QWEN_PROCESSOR: "e6dfad13458f15b3",
        f"{_QI}.apply_rotary_emb_qwen": "62c3cf93c5e4d4eb",
        _RMS_NORM: "ab9075d036873ac9",
        _DISPATCH: "cd20137f05eb6b2b",
    },
    "zimage attention (cuDNN, RoPE outside autocast)": {
        _Z_PROCESSOR: "f8f65d350a617957",
        _RMS_NORM: "ab9075d036873ac9",
        _DISPATCH: "cd20137f05eb6b2b",
    },
    "zimage attention (RoPE outside autocast)": {_Z_PROCESSOR: "f8f65d350a617957"},
    # fast mode's fused block paths (FP8): a block's forward inlined around our glue kernels
    "zimage fused block": {
        f"{_ZI}.ZImageTransformerBlock.forward": "0010ab78ad4019c9",
        _Z_FEED_FORWARD[0]: "1e3484a026a24699",
        _Z_FEED_FORWARD[1]: "4af06261e665f60e",
        _RMS_NORM: "ab9075d036873ac9",
    },
    "qwenimage fused block": {
        f"{_QI}.QwenImageTransformerBlock.forward": "89de238db44a7a47",
        f"{_QI}.QwenImageTransformerBlock._modulate": "9ee78b512057d504",
        _FLUX_FEED_FORWARD: "dae2c9f53987c25a",
        _GELU[0]: "538b05d6963a325c",
        _GELU[1]: "d203f2720ee05f35",
    },
    # fast mode's instance forwards: a module's forward re-implemented
    "fp8 feed-forward": {
        _FLUX_FEED_FORWARD: "dae2c9f53987c25a",
        _GELU[0]: "538b05d6963a325c",
        _GELU[1]: "d203f2720ee05f35",
        _Z_FEED_FORWARD[0]: "1e3484a026a24699",
        _Z_FEED_FORWARD[1]: "4af06261e665f60e",
    },
    "flux attention (fused prologue)": {
        f"{_FLUX}.FluxAttnProcessor.__call__": "d5b36134887ebe45",
        f"{_FLUX}._get_qkv_projections": "418c2abca63c6225",
        f"{_FLUX}._get_projections": "49221168b024c3c8",
        _ROTARY: "a25267d425f8c5ea",
        _DISPATCH: "cd20137f05eb6b2b",
    },
    "flux2 attention (fused prologue)": {
        f"{_FLUX2}.Flux2AttnProcessor.__call__": "2106c36979e28f30",
        f"{_FLUX2}._get_qkv_projections": "d5cc5f876e36a190",
        _ROTARY: "a25267d425f8c5ea",
        _DISPATCH: "cd20137f05eb6b2b",
    },
    "flux2 single-stream attention (fused prologue)": {
        f"{_FLUX2}.Flux2ParallelSelfAttnProcessor.__call__": "18a20dca47451835",
        _ROTARY: "a25267d425f8c5ea",
        _DISPATCH: "cd20137f05eb6b2b",
    },
    "wan attention (fp8 at the norms' bounds)": {
        "diffusers.models.transformers.transformer_wan.WanAttnProcessor.__call__": "13c09feedcfe814a",
        _DISPATCH: "cd20137f05eb6b2b",
    },
    "flux fp8 single block": {
        f"{_FLUX}.FluxSingleTransformerBlock.forward": "57350a6dab842b40",
        "diffusers.models.normalization.AdaLayerNormZeroSingle.forward": "d48dfb2b1e75e64f",
    },
    "flux fp8 double block": {
        f"{_FLUX}.FluxTransformerBlock.forward": "0b184cbe172708b6",
        "diffusers.models.normalization.AdaLayerNormZero.forward": "93374820c014f812",
        _FLUX_FEED_FORWARD: "dae2c9f53987c25a",
        _GELU[0]: "538b05d6963a325c",
        _GELU[1]: "d203f2720ee05f35",
    },
    "flux split single block": {f"{_FLUX}.FluxSingleTransformerBlock.forward": "57350a6dab842b40"},
    "gelu epilogue": {_GELU[0]: "538b05d6963a325c", _GELU[1]: "d203f2720ee05f35"},
    "vae decoder (fused)": {
        "diffusers.models.resnet.ResnetBlock2D.forward": "e3f38e1722955caf",
        "diffusers.models.upsampling.Upsample2D.forward": "3c0e13df5e4ac796",
        "diffusers.models.autoencoders.vae.Decoder.forward": "be96bf1aec1d895a",
    },
    "vae encoder (fused)": {
        "diffusers.models.resnet.ResnetBlock2D.forward": "e3f38e1722955caf",
        "diffusers.models.autoencoders.vae.Encoder.forward": "cf4410532c9ebdd5",
    },
    "wan vae decoder (fused)": {
        f"{_WAN_VAE}.WanCausalConv3d.forward": "afffb99acd515ba2",
        f"{_WAN_VAE}.WanRMS_norm.forward": "fc44101b65138738",
        f"{_WAN_VAE}.WanUpsample.forward": "8623452f43a3b2cf",
        f"{_WAN_VAE}.WanResample.forward": "3c0b8933703e5d76",
        f"{_WAN_VAE}.WanResidualBlock.forward": "82e9104df2acf11a",
        f"{_WAN_VAE}.WanDecoder3d.forward": "927efe06256e3b6d",
    },
    "qwenimage vae decoder (fused)": {
        f"{_QWEN_VAE}.QwenImageCausalConv3d.forward": "afffb99acd515ba2",
        f"{_QWEN_VAE}.QwenImageRMS_norm.forward": "fc44101b65138738",
        f"{_QWEN_VAE}.QwenImageUpsample.forward": "8623452f43a3b2cf",
        f"{_QWEN_VAE}.QwenImageResample.forward": "a9353b4101ae915c",
        f"{_QWEN_VAE}.QwenImageResidualBlock.forward": "fbb57ee09695bcd6",
        f"{_QWEN_VAE}.QwenImageDecoder3d.forward": "15e80f12b5d26379",
    },
    # the encoders: the decoders' residual blocks, convolutions and norms; diffusers' downsampling around them
    "wan vae encoder (fused)": {
        f"{_WAN_VAE}.WanCausalConv3d.forward": "afffb99acd515ba2",
        f"{_WAN_VAE}.WanRMS_norm.forward": "fc44101b65138738",
        f"{_WAN_VAE}.WanResample.forward": "3c0b8933703e5d76",
        f"{_WAN_VAE}.WanResidualBlock.forward": "82e9104df2acf11a",
        f"{_WAN_VAE}.WanEncoder3d.forward": "9bea31452fb7d0f6",
    },
    "qwenimage vae encoder (fused)": {
        f"{_QWEN_VAE}.QwenImageCausalConv3d.forward": "afffb99acd515ba2",
        f"{_QWEN_VAE}.QwenImageRMS_norm.forward": "fc44101b65138738",
        f"{_QWEN_VAE}.QwenImageResample.forward": "a9353b4101ae915c",
        f"{_QWEN_VAE}.QwenImageResidualBlock.forward": "fbb57ee09695bcd6",
        f"{_QWEN_VAE}.QwenImageEncoder3d.forward": "6635b9fc9393b650",
    },
    # both modes: Z-Image's captions padded to buckets of 32 tokens, the pad masks passed through patchify
    "zimage caption buckets": {
        f"{_ZI}.ZImageTransformer2DModel.patchify_and_embed": "3e3b2b2d5b2359c6",
        f"{_ZI}.ZImageTransformer2DModel._pad_with_ids": "d88fa2b77eb8eeb9",
        f"{_ZI}.ZImageTransformer2DModel._prepare_sequence": "179f5372e35d90f7",
        f"{_ZI}.ZImageTransformer2DModel.forward": "b0ae2e5b7a2d0743",
    },
    # both modes: HunyuanImage's forward with its text tokens joined by a sort (fixed shapes, no host syncs)
    "hunyuanimage joined text": {
        "diffusers.models.transformers.transformer_hunyuanimage.HunyuanImageTransformer2DModel.forward": (
            "213969c1fc1d9290"
        ),
    },
    # both modes: a single ControlNet's conditioning scale applied after its graphs (features.controlnet_scale),
    # right where its forward multiplies every sample it returns by it, last
    "controlnet scale (FLUX.1)": {f"{_CONTROLNETS}.controlnet_flux.FluxControlNetModel.forward": "3a5248d8064b9456"},
    "controlnet scale (SD3)": {f"{_CONTROLNETS}.controlnet_sd3.SD3ControlNetModel.forward": "96fc15eae15fdf05"},
    "controlnet scale (Qwen-Image)": {
        f"{_CONTROLNETS}.controlnet_qwenimage.QwenImageControlNetModel.forward": "ec408c966cc3f5ea"
    },
    "controlnet scale (Sana)": {f"{_CONTROLNETS}.controlnet_sana.SanaControlNetModel.forward": "82febebea4c12750"},
    # ... and in the wrappers of several ControlNets, split into each condition's call and their sum
    # (patches.multi_controlnet; the wrapper's forward first, then the ControlNet's it calls)
    "controlnet scale, each condition (FLUX.1)": {
        f"{_CONTROLNETS}.controlnet_flux.FluxMultiControlNetModel.forward": "0c973d8157150bc5",
        f"{_CONTROLNETS}.controlnet_flux.FluxControlNetModel.forward": "3a5248d8064b9456",
    },
    "controlnet scale, each condition (SD3)": {
        f"{_CONTROLNETS}.controlnet_sd3.SD3MultiControlNetModel.forward": "1bb254cc69f6ba26",
        f"{_CONTROLNETS}.controlnet_sd3.SD3ControlNetModel.forward": "96fc15eae15fdf05",
    },
    "controlnet scale, each condition (Qwen-Image)": {
        f"{_CONTROLNETS}.controlnet_qwenimage.QwenImageMultiControlNetModel.forward": "780b9a5e697632e8",
        f"{_CONTROLNETS}.controlnet_qwenimage.QwenImageControlNetModel.forward": "ec408c966cc3f5ea",
    },
    # step caching: how each of diffusers' cache hooks decides, and what it keeps (mirrored in step_caching.kinds)
    "step caching: FirstBlockCache": {
        f"{_HOOKS}.first_block_cache.FBCSharedBlockState.__init__": "3b727d7dfabe1778",
        f"{_HOOKS}.first_block_cache.FBCHeadBlockHook.new_forward": "8a70eb4637ed9503",
        f"{_HOOKS}.first_block_cache.FBCHeadBlockHook._should_compute_remaining_blocks": "9aa23f94a7226754",
        f"{_HOOKS}.first_block_cache.FBCBlockHook.new_forward": "c8364de4d6d7550f",
    },
    "step caching: MagCache": {
        f"{_HOOKS}.mag_cache.MagCacheState.__init__": "56d55e675e24799d",
        f"{_HOOKS}.mag_cache.MagCacheHeadHook.new_forward": "a3afbbcf73474682",
        f"{_HOOKS}.mag_cache.MagCacheBlockHook.new_forward": "0676e355b9f12730",
        f"{_HOOKS}.mag_cache.MagCacheBlockHook._advance_step": "ec3b86a3268672b6",
    },
    "step caching: TaylorSeer": {
        f"{_HOOKS}.taylorseer_cache.TaylorSeerState.__init__": "a7180673eb9b013e",
        f"{_HOOKS}.taylorseer_cache.TaylorSeerState.update": "a042a8ccb6ea07f9",
        f"{_HOOKS}.taylorseer_cache.TaylorSeerState.predict": "9735e2ab83b90f1d",
        f"{_HOOKS}.taylorseer_cache.TaylorSeerCacheHook._measure_should_compute": "5b33ef14637ad27b",
        f"{_HOOKS}.taylorseer_cache.TaylorSeerCacheHook.new_forward": "3b4063f731e02278",
    },
    # Cache-DiT: its cached blocks call its state only through the methods made eager breaks (step_caching.cachedit)
    "step caching: Cache-DiT": {
        f"{_CACHE_DIT}.cache_blocks.pattern_base.CachedBlocks_Pattern_Base.forward": "563d0d920528b033",
        f"{_CACHE_DIT}.cache_blocks.pattern_base.CachedBlocks_Pattern_Base.call_Fn_blocks": "2928dd75933f074f",
        f"{_CACHE_DIT}.cache_blocks.pattern_base.CachedBlocks_Pattern_Base.call_Mn_blocks": "f71303d9bc816d7e",
        f"{_CACHE_DIT}.cache_blocks.pattern_base.CachedBlocks_Pattern_Base.call_Bn_blocks": "b2ae6d11280e1203",
        f"{_CACHE_DIT}.cache_blocks.pattern_3_4_5.CachedBlocks_Pattern_3_4_5.forward": "6889b2f01832cdc8",
        f"{_CACHE_DIT}.cache_blocks.pattern_3_4_5.CachedBlocks_Pattern_3_4_5.call_Fn_blocks": "f90c12d55d8d2578",
        f"{_CACHE_DIT}.cache_blocks.pattern_3_4_5.CachedBlocks_Pattern_3_4_5.call_Mn_blocks": "a74a4284eeeb97a7",
        f"{_CACHE_DIT}.cache_blocks.pattern_3_4_5.CachedBlocks_Pattern_3_4_5.call_Bn_blocks": "18ed5bc1f1e8ac1a",
        f"{_CACHE_DIT}.cache_contexts.cache_manager.CachedContextManager.set_context": "d68927da9b9e8196",
        f"{_CACHE_DIT}.cache_contexts.cache_manager.CachedContextManager.can_cache": "af14fccac435c181",
        f"{_CACHE_DIT}.cache_contexts.cache_manager.CachedContextManager.similarity": "1520e86e8e955d6a",
        f"{_CACHE_DIT}.cache_contexts.cache_manager.CachedContextManager.apply_cache": "0108631d6a82b6fb",
        f"{_CACHE_DIT}.cache_contexts.cache_manager.CachedContextManager.set_Fn_buffer": "4d1c7a80294cc001",
        f"{_CACHE_DIT}.cache_contexts.cache_manager.CachedContextManager.set_Bn_buffer": "ebb4de7bed51be95",
        f"{_CACHE_DIT}.cache_contexts.cache_manager.CachedContextManager.set_Bn_encoder_buffer": "d19016e0e1872ef2",
        f"{_CACHE_DIT}.cache_contexts.cache_context.CachedContext.mark_step_begin": "fab2b01ccff821a3",
        f"{_CACHE_DIT}.cache_contexts.cache_context.CachedContext.add_cached_step": "f9997caf3df73ff8",
        f"{_CACHE_DIT}.cache_contexts.calibrators.taylorseer.TaylorSeerState.update": "d2c656fca9b752e7",
        f"{_CACHE_DIT}.cache_contexts.calibrators.taylorseer.TaylorSeerState.derivative": "03aa4178e8c265a2",
        f"{_CACHE_DIT}.cache_contexts.calibrators.taylorseer.TaylorSeerState.approximate": "6319025b5f59fae1",
        f"{_CACHE_DIT}.cache_contexts.calibrators.taylorseer.TaylorSeerCalibrator.update": "a0982f1c06ccf2c8",
        f"{_CACHE_DIT}.cache_contexts.calibrators.taylorseer.TaylorSeerCalibrator.approximate": "06346c7bf511d0ea",
        f"{_CACHE_DIT}.cache_adapters.cache_adapter.CachedAdapter.mock_transformer": "02eff48b7adab224",
    },
}

_DIGESTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
# patch -> (ids of the functions it names, those objects, what changed): changed()'s answer while they stay
_VERDICTS: dict[str, tuple[tuple[int, ...], list[Any], list[str]]] = {}


def resolve(path: str) -> Any:
    """The object a dotted path names: its package, then attributes, importing submodules on the way (a
    class's attributes read as its ``__dict__`` holds them; a property's getter). Raises ImportError or
    AttributeError."""
    parts = path.split(".")
    target: Any = sys.modules.get(parts[0]) or importlib.import_module(parts[0])
    for index in range(1, len(parts)):
        name = parts[index]
        if isinstance(target, types.ModuleType):
            module = sys.modules.get(f"{target.__name__}.{name}")
            if module is None and name not in vars(target):
                module = importlib.import_module(".".join(parts[: index + 1]))
            target = module if module is not None else getattr(target, name)
            continue
        target = inspect.getattr_static(target, name) if isinstance(target, type) else getattr(target, name)
        target = getattr(target, "__func__", target)  # staticmethod, classmethod
        if isinstance(target, property):
            target = target.fget
    return target


def digest(path: str) -> str:
    """The digest of the source of the function ``path`` names, as installed now (see the module docstring).
    Raises ImportError, AttributeError (not there) or OSError / TypeError (no source to read)."""
    return _digest_of(resolve(path))


def _digest_of(target: Any) -> str:
    with contextlib.suppress(KeyError, TypeError):
        return _DIGESTS[target]
    value = hashlib.sha256(inspect.getsource(target).encode()).hexdigest()[:16]
    with contextlib.suppress(TypeError):  # not weakly referenceable: computed again next time
        _DIGESTS[target] = value
    return value


def _version(path: str) -> str:
    package = "cache-dit" if path.startswith("cache_dit") else path.split(".")[0]
    try:
        return f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{package} (version unknown)"


def changed(patch: str) -> list[str]:
    """What differs, for ``patch``, from the code it was written against: one line per function whose source
    is not the tested one (or cannot be read), naming the installed version. Empty when all match. Kept per
    patch while the functions it names are the same objects (a few microseconds a call after the first).

    Raises KeyError for a patch :data:`FOLLOWED` does not list."""
    objects: list[Any] = []
    for path in FOLLOWED[patch]:
        try:
            objects.append(resolve(path))
        except (ImportError, AttributeError) as exc:
            objects.append(exc)
    key = tuple(map(id, objects))
    known = _VERDICTS.get(patch)
    if known is not None and known[0] == key and all(map(operator.is_, known[1], objects)):
        return known[2]
    found = []
    for (path, expected), target in zip(FOLLOWED[patch].items(), objects):
        try:
            if isinstance(target, Exception):
                raise target
            if _digest_of(target) == expected:
                continue
            found.append(f"{path} differs from the code it was written for ({_version(path)} installed)")
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            found.append(f"{path} cannot be read ({type(exc).__name__}: {exc}; {_version(path)} installed)")
    _VERDICTS[patch] = (key, objects, found)
    return found


def installable(patch: str, stacklevel: int = 3) -> bool:
    """Whether ``patch`` may be installed: True when every function it depends on is the code it was written
    for; otherwise False, after one :class:`~bcg_diffusion.BCGWarning` naming the patch, the first function
    that differs and the installed version (Python's warning filters show it once per place)."""
    found = changed(patch)
    if not found:
        return True
    from ..core.runner import BCGWarning

    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    tested = ", ".join(f"{name} {' / '.join(versions)}" for name, versions in TESTED.items())
    message = (
        f"bcg-diffusion: patch {patch!r} is not installed: {found[0]}{more}. It was written against {tested}; "
        "without it the component keeps its graphs without this optimisation or runs eagerly, exact either way"
    )
    logger.warning("%s", message)
    warnings.warn(message, BCGWarning, stacklevel=stacklevel)
    return False
