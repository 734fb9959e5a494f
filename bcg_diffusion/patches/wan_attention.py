"""Fast mode with cuDNN's FP8 attention: Wan's query and key quantized at the bounds their norms give.

Wan's attention processor (``WanAttnProcessor`` of ``transformer_wan``: Wan 2.1, Wan 2.2's experts, VACE)
RMS-norms its query and key across all heads (``torch.nn.RMSNorm`` over ``heads * head_dim``), rotates them
in self-attention, and attends through diffusers' dispatcher. Under ``attention="fp8"`` with cuDNN's kernel,
the generic dispatch (:mod:`bcg_diffusion.patches.dispatched_attention`) scales each tensor by its largest
magnitude: a reduction over the whole tensor, so inductor writes the normed, rotated query and key in bf16,
reads them once to reduce and once more to quantize. An RMS norm bounds its output without a reduction: no
element of a row of ``n`` normed elements exceeds ``max|w| * sqrt(n)``, and a rotation of pairs keeps that
(:func:`~bcg_diffusion.kernels.cudnn_fp8_attention.rms_norm_bound`). Given the bounds, the quantization is
pointwise, and inductor writes the query and key in float8 from the norm's own kernel. The value has no
bound; its largest magnitude is still reduced.

At Wan's ``n`` of 5,120 the bound is looser than FLUX's per-head one (``sqrt(128)``): the scale spends about
2.6 binades of e4m3's range on values the rows never reach, which costs precision only below
``0.0025 * max|w|``. On random rows with norm weights around 1, attention's error against float32 was the
same with either scale (5.9% and 7.0%: the probabilities' e4m3 rounding dominates). Wan 2.1 14B at 832×480, 81
frames, CFG 5, on one H100: 3.960, 3.969 and 3.950 s a step against 3.988, 3.985 and 3.979 s with the largest
magnitudes (0.4–0.7%, the benchmark's ``fast-fp8-attn`` against ``fast-fp8-attn-bf16-prologue`` in both orders,
runs 230, 231 and 233), with the same PSNR against bf16 eager.

The ``__call__`` below is diffusers' (0.42), with each attention call through :func:`_attention`'s. Every call
that is not plain or whose norms give no bound, and every call where the module chose the largest magnitudes
(``features.fp8_attention.choose_prologue(model, False)``), goes to the processor's own
``dispatch_attention_fn`` as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..kernels import cudnn_fp8_attention
from .dispatched_attention import DISPATCH_NAME, fp8_prologue_wanted, sends_to_cudnn_fp8
from .scoped import ProcessorPatch

__all__ = ["WAN_ATTENTION_PATCH"]

WAN_MODULE = "diffusers.models.transformers.transformer_wan"
# Wan's text context: diffusers' processor takes the image context as what comes before its last 512 tokens.
TEXT_TOKENS = 512


def _norm_bound(norm: Any, size: int) -> torch.Tensor | None:
    """The bound on ``norm``'s outputs where it is a ``torch.nn.RMSNorm`` with a weight over ``size``
    elements (a row across every head); None otherwise."""
    if type(norm) is not torch.nn.RMSNorm or norm.weight is None or tuple(norm.normalized_shape) != (size,):
        return None
    return cudnn_fp8_attention.rms_norm_bound([norm.weight], size)


def _rotate(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb`` inside ``WanAttnProcessor.__call__`` (0.42), operation for operation."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def _attention(call: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """Attention for the processor whose (possibly FP8-scoped) ``__call__`` is ``call``: cuDNN's FP8 kernel
    given the norms' bounds where :func:`fp8_prologue_wanted` and the tensors allow it, else ``call``'s own
    ``dispatch_attention_fn``."""
    dispatch = call.__globals__[DISPATCH_NAME]

    def attend(
        processor: Any,
        attn: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_norm: torch.nn.Module,
        attention_mask: torch.Tensor | None,
        parallel_config: Any,
    ) -> torch.Tensor:
        if parallel_config is None and fp8_prologue_wanted(processor, attn, attention_mask):
            size = query.shape[-2] * query.shape[-1]
            bounds = _norm_bound(attn.norm_q, size), _norm_bound(key_norm, size)
            if None not in bounds and cudnn_fp8_attention.unsupported(query, key, value) is None:
                return cudnn_fp8_attention.attention(query, key, value, *bounds)
        return dispatch(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=processor._attention_backend,
            parallel_config=parallel_config,
        )

    return attend


def _wan_call(call: Callable[..., Any]) -> Callable[..., Any]:
    """``WanAttnProcessor.__call__`` (diffusers 0.42) with attention through :func:`_attention`, the
    projections through the helpers ``call``'s module binds."""
    attend = _attention(call)
    get_qkv_projections = call.__globals__["_get_qkv_projections"]
    get_added_kv_projections = call.__globals__["_get_added_kv_projections"]

    def __call__(
        self: Any,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        encoder_hidden_states_img = None
        if attn.add_k_proj is not None:  # image-to-video: the image's context comes before the text's
            image_context_length = encoder_hidden_states.shape[1] - TEXT_TOKENS
            encoder_hidden_states_img = encoder_hidden_states[:, :image_context_length]
            encoder_hidden_states = encoder_hidden_states[:, image_context_length:]
        query, key, value = get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            query, key = _rotate(query, *rotary_emb), _rotate(key, *rotary_emb)

        hidden_states_img = None
        if encoder_hidden_states_img is not None:
            key_img, value_img = get_added_kv_projections(attn, encoder_hidden_states_img)
            key_img = attn.norm_added_k(key_img)
            key_img, value_img = key_img.unflatten(2, (attn.heads, -1)), value_img.unflatten(2, (attn.heads, -1))
            hidden_states_img = attend(self, attn, query, key_img, value_img, attn.norm_added_k, None, None)
            hidden_states_img = hidden_states_img.flatten(2, 3).type_as(query)

        parallel_config = self._parallel_config if encoder_hidden_states is None else None
        hidden_states = attend(self, attn, query, key, value, attn.norm_k, attention_mask, parallel_config)
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        if hidden_states_img is not None:
            hidden_states = hidden_states + hidden_states_img
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)

    return __call__


def _unused(model: torch.nn.Module) -> str | None:
    """Why the patch does not apply to ``model``: none of its processors sends plain calls to cuDNN's FP8
    kernel (``attention="fp8"`` installs that before fast mode's patches), so the bounds would go unused."""
    if any(sends_to_cudnn_fp8(module.__dict__.get("processor")) for module in model.modules()):
        return None
    return "no attention processor sends its calls to cuDNN's FP8 kernel"


WAN_ATTENTION_PATCH = ProcessorPatch(
    name="wan attention (fp8 at the norms' bounds)",
    processor_class="WanAttnProcessor",
    processor_module=WAN_MODULE,
    wrap_call=_wan_call,
    condition=_unused,
)
