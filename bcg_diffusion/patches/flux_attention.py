"""Fast mode: FLUX's attention prologue in one launch of our kernel.

Before attention, FLUX.1's and FLUX.2's processors RMS-norm the query and key over the head size
(``torch.nn.RMSNorm``), join the text and image streams (text first) in the double-stream blocks, and rotate
the query and key with diffusers' ``apply_rotary_emb(use_real=True)``. Compiled, inductor runs this for a
FLUX.1 single block as one looped reduction kernel: 4.7 ms of a 131.5 ms step at 1024² (38 blocks, H100,
run 168), about three times the time to read and write the query and key once. The double blocks take
1.9 ms in four kernels more. Under cuDNN's FP8 attention, the query, key and value of each call are then
reduced to their largest magnitudes and quantized in passes of their own: about 10 ms of a 95 ms step with
the prologue (run 168). The fused kernel of :mod:`bcg_diffusion.kernels.qk_prologue` does the prologue in one
pass (``norm="torch"``, frequencies as ``(cos, sin)``): :func:`~bcg_diffusion.kernels.qk_prologue.norm_rope`
for a single-stream block, :func:`~bcg_diffusion.kernels.qk_prologue.joint_qkv` with one group for a
double-stream one. With cuDNN's FP8 attention it writes the query and key in float8 itself, scaled by the
bounds their RMS norms give (FLUX's frequencies are rotations, which keep those bounds), and reduces the
value's largest magnitude on the way, as Qwen-Image's and Z-Image's processors do. FLUX.1-dev 1024², 28 steps,
against inductor's prologue on one H100 (runs 173 and 174): ``fast`` 3.738 against 3.817 s, ``fast-fp8``
2.615 against 2.689 s, with cuDNN's FP8 attention 2.434 against 2.641 s.

Each processor's ``__call__`` below is diffusers' (0.42), with the prologue through the kernel where the
module's choice (``patches.attention.QK_PROLOGUE_ATTRIBUTE``, by default: on a CUDA GPU with Triton) and the
tensors allow it. Elsewhere it runs diffusers' own steps, so on a CPU the patched processor gives the
unpatched one's bytes; with the kernel's PyTorch reference forced (``"fused"``) too. Attention itself goes to
the processor's own ``dispatch_attention_fn``: diffusers', or the one FP8 attention gave its class
(:mod:`bcg_diffusion.patches.dispatched_attention`), whose kernel choice the class also names.

``FluxAttnProcessor``'s also takes its image stream quantized already (an ``Fp8Rows`` from fast mode's FP8
FLUX block, :mod:`bcg_diffusion.patches.flux_block`): its query, key and value products then run torchao's FP8
product on those rows instead of torchao quantizing the norm's output for them.

Serves the processors named in :data:`FLUX_PROCESSORS`: FLUX.1 (and Kontext, Fill, the other FLUX.1
pipelines) and FLUX.2 (dev and klein).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..kernels import cudnn_fp8_attention, qk_prologue
from .attention import TAKES_FP8_ROWS, _fused_prologue
from .dispatched_attention import DISPATCH_NAME, fp8_prologue_wanted
from .fp8_feed_forward import Fp8Rows, linear_on_fp8
from .scoped import ProcessorPatch

__all__ = ["FLUX_ATTENTION_PATCHES", "FLUX_PROCESSORS"]

# (processor class, the patch's name) for each processor this module rewrites
FLUX_PROCESSORS = (
    ("FluxAttnProcessor", "flux attention (fused prologue)"),
    ("Flux2AttnProcessor", "flux2 attention (fused prologue)"),
    ("Flux2ParallelSelfAttnProcessor", "flux2 single-stream attention (fused prologue)"),
)


def _torch_norms(norms: Sequence[Any], head_dim: int) -> tuple[list[torch.Tensor], list[float]] | None:
    """The weights and epsilons of ``norms`` where each is a ``torch.nn.RMSNorm`` over ``head_dim`` with a
    weight (the kernel's ``norm="torch"``); None otherwise."""
    if not all(
        type(norm) is torch.nn.RMSNorm and norm.weight is not None and tuple(norm.normalized_shape) == (head_dim,)
        for norm in norms
    ):
        return None
    # torch.nn.RMSNorm's eps=None is float32's machine epsilon for every dtype the kernel takes
    return [norm.weight for norm in norms], [torch.finfo(torch.float32).eps if n.eps is None else n.eps for n in norms]


def _cos_sin(image_rotary_emb: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """FLUX's frequencies as the kernel takes them (a ``(cos, sin)`` pair of tensors), else None."""
    pair = isinstance(image_rotary_emb, tuple | list) and len(image_rotary_emb) == 2
    return tuple(image_rotary_emb) if pair and all(isinstance(f, torch.Tensor) for f in image_rotary_emb) else None


def _fused_attention(
    processor: Any,
    attn: torch.nn.Module,
    image: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    text: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    attention_mask: torch.Tensor | None,
    image_rotary_emb: Any,
    dispatch: Callable[..., torch.Tensor],
) -> torch.Tensor | None:
    """Attention over ``text`` (None: a single stream) then ``image`` (query, key, value ``[B, S, H, D]``
    each, unnormed, unrotated) with the prologue in one launch; ``[B, S, H, D]`` out, in the value's dtype.
    None where the kernel does not take them (the caller runs diffusers' steps)."""
    head_dim = image[0].shape[-1]
    norms = (
        (attn.norm_q, attn.norm_k)
        if text is None
        else (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)
    )
    found = _torch_norms(norms, head_dim)
    freqs = None if image_rotary_emb is None else _cos_sin(image_rotary_emb)
    if found is None or (image_rotary_emb is not None and freqs is None):
        return None
    weights, eps = found
    query, key, value = image
    if fp8_prologue_wanted(processor, attn, attention_mask):
        quantized = _fused_fp8(image, text, weights, eps, freqs)
        if quantized is not None:
            return cudnn_fp8_attention.attention_quantized(*quantized)
    if text is None:
        if qk_prologue.unsupported_norm_rope(query, key, weights, freqs, norm="torch") is not None:
            return None
        query, key = qk_prologue.norm_rope(query, key, weights, eps, freqs, norm="torch")
    else:
        stream_freqs, lengths = _streams(freqs, text[0].shape[1])
        if qk_prologue.unsupported_joint(image, text, weights, stream_freqs, lengths, norm="torch") is not None:
            return None
        query, key, value = qk_prologue.joint_qkv(image, text, weights, eps, stream_freqs, lengths, norm="torch")
    options = {"backend": processor._attention_backend, "parallel_config": processor._parallel_config}
    return dispatch(query, key, value, attn_mask=attention_mask, **options)


def _streams(freqs: tuple[torch.Tensor, torch.Tensor] | None, text_tokens: int) -> tuple[tuple, tuple[int]]:
    """The joint sequence's frequencies split into the image's and the text's (text first), and the one
    group of rows whose text is all valid."""
    if freqs is None:
        return (None, None), (text_tokens,)
    cos, sin = freqs
    return ((cos[text_tokens:], sin[text_tokens:]), (cos[:text_tokens], sin[:text_tokens])), (text_tokens,)


def _fused_fp8(
    image: tuple[torch.Tensor, ...],
    text: tuple[torch.Tensor, ...] | None,
    weights: list[torch.Tensor],
    eps: list[float],
    freqs: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, ...] | None:
    """``cudnn_fp8_attention.attention_quantized``'s arguments from the fused prologue: the query and key in
    float8 at their norms' bounds, their descales, the value and its largest magnitude. None where cuDNN's
    kernel or the prologue does not take the tensors."""
    if cudnn_fp8_attention.unsupported(*image) is not None:  # the text stream matches it (the prologue checks)
        return None
    head_dim = image[0].shape[-1]
    # the query's norms (the image's, then the text's in a double-stream block), and the key's
    bounds = (
        cudnn_fp8_attention.rms_norm_bound(weights[0::2], head_dim),
        cudnn_fp8_attention.rms_norm_bound(weights[1::2], head_dim),
    )
    descales = tuple(cudnn_fp8_attention.descale(bound) for bound in bounds)
    if text is None:
        query, key, value = image
        reason = qk_prologue.unsupported_norm_rope_fp8(query, key, value, weights, freqs, descales, norm="torch")
        if reason is not None:
            return None
        query8, key8, largest = qk_prologue.norm_rope_fp8(
            query, key, value, weights, eps, freqs, *descales, norm="torch"
        )
        return query8, key8, *descales, value, largest
    stream_freqs, lengths = _streams(freqs, text[0].shape[1])
    if qk_prologue.unsupported_joint_fp8(image, text, weights, stream_freqs, lengths, descales, norm="torch"):
        return None
    fused = qk_prologue.joint_qkv_fp8(image, text, weights, eps, stream_freqs, lengths, *descales, norm="torch")
    return fused.query, fused.key, fused.query_descale, fused.key_descale, fused.value, fused.value_largest[0]


def _heads(attn: torch.nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.unflatten(-1, (-1, attn.head_dim)) for t in tensors)


def _diffusers_attention(
    processor: Any,
    attn: torch.nn.Module,
    image: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    text: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    attention_mask: torch.Tensor | None,
    image_rotary_emb: Any,
    dispatch: Callable[..., torch.Tensor],
    apply_rotary_emb: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """diffusers' steps from the projections to attention's output ``[B, S, H, D]``, as its FLUX processors
    take them: each stream's query and key normed, text joined before image, RoPE, dispatch."""
    query, key, value = image
    query, key = attn.norm_q(query), attn.norm_k(key)
    if text is not None:
        encoder_query, encoder_key, encoder_value = text
        encoder_query, encoder_key = attn.norm_added_q(encoder_query), attn.norm_added_k(encoder_key)
        query = torch.cat([encoder_query, query], dim=1)
        key = torch.cat([encoder_key, key], dim=1)
        value = torch.cat([encoder_value, value], dim=1)
    if image_rotary_emb is not None:
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
    options = {"backend": processor._attention_backend, "parallel_config": processor._parallel_config}
    return dispatch(query, key, value, attn_mask=attention_mask, **options)


def _attention(call: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """Attention from the projections for the processor whose (possibly FP8-scoped) ``__call__`` is ``call``:
    through the fused prologue where :func:`_fused_attention` takes the call, else diffusers' steps, each with
    the names ``dispatch_attention_fn`` and ``apply_rotary_emb`` as ``call``'s module binds them."""
    dispatch, apply_rotary_emb = call.__globals__[DISPATCH_NAME], call.__globals__["apply_rotary_emb"]

    def attention(
        processor: Any,
        attn: torch.nn.Module,
        image: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        text: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
        image_rotary_emb: Any,
    ) -> torch.Tensor:
        if _fused_prologue(attn, image[0]):
            out = _fused_attention(processor, attn, image, text, attention_mask, image_rotary_emb, dispatch)
            if out is not None:
                return out
        args = (processor, attn, image, text, attention_mask, image_rotary_emb)
        return _diffusers_attention(*args, dispatch, apply_rotary_emb)

    return attention


def _split(hidden_states: torch.Tensor, text_tokens: int) -> list[torch.Tensor]:
    return hidden_states.split_with_sizes([text_tokens, hidden_states.shape[1] - text_tokens], dim=1)


def _flux_outputs(attn: torch.nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: Any) -> Any:
    """``FluxAttnProcessor``'s end (diffusers 0.42): a single stream's attention output as it is; with a text
    stream, each stream's output projection."""
    if encoder_hidden_states is None:
        return hidden_states
    encoder_hidden_states, hidden_states = _split(hidden_states, encoder_hidden_states.shape[1])
    hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
    return hidden_states, attn.to_add_out(encoder_hidden_states.contiguous())


def _flux2_outputs(attn: torch.nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: Any) -> Any:
    """``Flux2AttnProcessor``'s end (diffusers 0.42): the image's output projection always, the text's where
    there is a text stream."""
    if encoder_hidden_states is not None:
        encoder_hidden_states, hidden_states = _split(hidden_states, encoder_hidden_states.shape[1])
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
    hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
    return hidden_states if encoder_hidden_states is None else (hidden_states, encoder_hidden_states)


def _projections_of_fp8_rows(
    attn: torch.nn.Module, rows: Fp8Rows, encoder_hidden_states: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """diffusers' ``_get_projections`` (FLUX, 0.42) for an image stream quantized already (:class:`Fp8Rows`,
    from fast mode's FLUX block, :mod:`bcg_diffusion.patches.flux_block`): the image's query, key and value
    by torchao's products on those rows, the text's by its own projections. Raises ValueError where the
    module projects in one fused product (``fuse_projections``), which the rows were not made for."""
    if attn.fused_projections:
        raise ValueError("a FLUX attention with fused projections cannot take an input quantized already")
    query, key, value = (linear_on_fp8(linear, *rows) for linear in (attn.to_q, attn.to_k, attn.to_v))
    if encoder_hidden_states is None or attn.added_kv_proj_dim is None:
        return query, key, value, None, None, None
    text = tuple(linear(encoder_hidden_states) for linear in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
    return query, key, value, *text


def _two_stream_call(
    call: Callable[..., Any],
    outputs: Callable[[torch.nn.Module, torch.Tensor, Any], Any],
    takes_fp8_rows: bool = False,
) -> Callable[..., Any]:
    """A ``__call__`` for ``FluxAttnProcessor`` or ``Flux2AttnProcessor`` (``outputs``: its end): diffusers'
    (0.42), with attention from the projections through :func:`_attention`; with ``takes_fp8_rows``, its image
    stream may come quantized already (:class:`Fp8Rows`, :func:`_projections_of_fp8_rows`)."""
    attention, get_qkv_projections = _attention(call), call.__globals__["_get_qkv_projections"]

    def __call__(
        self: Any,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor | Fp8Rows,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> Any:
        if isinstance(hidden_states, Fp8Rows):
            projections = _projections_of_fp8_rows(attn, hidden_states, encoder_hidden_states)
        else:
            projections = get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query, key, value, encoder_query, encoder_key, encoder_value = projections
        image = _heads(attn, query, key, value)
        joint = attn.added_kv_proj_dim is not None
        text = _heads(attn, encoder_query, encoder_key, encoder_value) if joint else None
        out = attention(self, attn, image, text, attention_mask, image_rotary_emb)
        return outputs(attn, out.flatten(2, 3).to(image[0].dtype), encoder_hidden_states)

    if takes_fp8_rows:
        setattr(__call__, TAKES_FP8_ROWS, True)
    return __call__


def _parallel_call(call: Callable[..., Any]) -> Callable[..., Any]:
    """A ``__call__`` for ``Flux2ParallelSelfAttnProcessor`` (FLUX.2's single-stream blocks: query, key,
    value and MLP input in one product): diffusers' (0.42), with attention through :func:`_attention`."""
    attention = _attention(call)

    def __call__(
        self: Any,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> torch.Tensor:
        hidden_states = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = hidden_states.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp_hidden_states = torch.split(hidden_states, [local_qkv, hidden_states.shape[-1] - local_qkv], dim=-1)
        image = _heads(attn, *qkv.chunk(3, dim=-1))
        hidden_states = attention(self, attn, image, None, attention_mask, image_rotary_emb)
        hidden_states = hidden_states.flatten(2, 3).to(image[0].dtype)
        mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
        return attn.to_out(torch.cat([hidden_states, mlp_hidden_states], dim=-1))

    return __call__


_CALLS = {
    "FluxAttnProcessor": lambda call: _two_stream_call(call, _flux_outputs, takes_fp8_rows=True),
    "Flux2AttnProcessor": lambda call: _two_stream_call(call, _flux2_outputs),
    "Flux2ParallelSelfAttnProcessor": _parallel_call,
}
FLUX_ATTENTION_PATCHES = tuple(
    ProcessorPatch(name=name, processor_class=processor, wrap_call=_CALLS[processor])
    for processor, name in FLUX_PROCESSORS
)
