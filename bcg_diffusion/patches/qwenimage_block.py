"""Fast mode under FP8: a Qwen-Image block's glue in kernels of ours, each product's FP8 input made by the
kernel before it.

A Qwen-Image block (``QwenImageTransformerBlock``) runs, on its image and its text stream, a LayerNorm with
``1 + scale`` and ``shift`` modulation before attention's query, key and value products, a gated residual
after attention, the same norm and modulation before the feed-forward and a gated residual after it (the
lines are in :mod:`bcg_diffusion.kernels.block_glue`). With torchao's row-wise FP8 weights each product
quantizes its input first. Compiled, inductor makes that glue kernels of its own at 0.8–2.9 TB/s on an H200
(the norms with modulation and FP8 rows 0.099 + 0.065 ms, the gated residual 0.053 ms of a 2.9 ms block at
1024² with CFG, run 99). The patched forward runs, for the image stream (and for the text stream where its
products are FP8 too; ``quantize="fp8"`` leaves them in bf16 by default), the norm with its modulation and
FP8 rows (:func:`~bcg_diffusion.kernels.block_glue.modulated_layer_norm_fp8`), hands those rows to fast
mode's processor, which runs torchao's products for query, key and value on them; the attention's gated
residual with the feed-forward's norm, modulation and FP8 rows
(:func:`~bcg_diffusion.kernels.block_glue.gated_add_layer_norm_fp8`); the feed-forward as fast mode's FP8
feed-forward runs it (:func:`bcg_diffusion.kernels.activation_fp8.gelu_fp8` between torchao's products); and
the feed-forward's gated residual (:func:`~bcg_diffusion.kernels.block_glue.gated_add`). A stream in bf16
runs the class's own steps.

Qwen-Image-Edit-2511's blocks (``zero_cond_t``) modulate the image stream per token: the input image's tokens
with the modulation of timestep 0, the others with the step's (``modulate_index``, and twice the modulation
rows). The kernels take that index and pick each token's modulation row themselves; the text stream keeps the
step's modulation. Edit-2511 1024², 8 steps, CFG 4, ``fast-fp8``: 3.679 s against 3.758 s with inductor's glue
(H100, run 175).

The same steps as the unpatched block with fast mode's FP8 feed-forward and processor: on a CPU, where the
operators run their PyTorch references, the patched forward gives the unpatched one's bytes. On a GPU the
kernels' float32 arithmetic is a few ulps from PyTorch's; fast mode allows it, its contract being with its
own compiled blocks, which run the same kernels.

Applies to a block whose four norms are LayerNorms without weight or bias, whose image stream's query, key
and value projections are plain ``nn.Linear`` with torchao's row-wise FP8 weights, and whose image
feed-forward takes fast mode's FP8 kernel (:func:`bcg_diffusion.patches.fp8_feed_forward.unfit`, chosen
``"fused"``), not chosen off (:func:`bcg_diffusion.patches.block_glue.choose`): :func:`unfit` says why a
block is left as it is. Checked again at every call (types, identities, shapes: dynamo turns them into
guards): a ``modulate_index`` without ``zero_cond_t`` (or the reverse), or one the kernels do not take, an
attention that would run diffusers' processor (a text mask without fast mode's text lengths), an image
projection replaced or wrapped, or a stream the kernels do not take runs the class's forward; a text
projection that is not a plain FP8 ``nn.Linear`` sends the text stream through the class's steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..core.hooks import MethodPatches
from ..kernels import block_glue
from .attention import TAKES_FP8_ROWS, TEXT_LENGTHS_KWARG, qwen_per_group_lengths
from .block_glue import gated_feed_forward_fp8, patch_blocks, plain_layer_norm, unfit_class
from .fp8_feed_forward import (
    FP8_FEED_FORWARD_ATTRIBUTE,
    FP8_FEED_FORWARD_DEFAULT,
    Fp8Rows,
    gelu_feed_forward_ready,
    plain_fp8_linear,
    unfit_chosen,
    unfit_fp8_projections,
)

__all__ = ["QWENIMAGE_BLOCK_PATCH", "fused_block_forward", "patch_qwenimage_blocks", "unfit"]

QWENIMAGE_BLOCK_PATCH = "Qwen-Image FP8 block: norms, modulation, gated residuals and FP8 inputs in three kernels"
_QWEN_IMAGE = "diffusers.models.transformers.transformer_qwenimage"
_NORMS = ("img_norm1", "img_norm2", "txt_norm1", "txt_norm2")


class _Stream(NamedTuple):
    """Where a block keeps one stream's modules (attribute names)."""

    projections: tuple[str, str, str]  # on the attention module
    norms: tuple[str, str]
    feed_forward: str


_IMAGE = _Stream(("to_q", "to_k", "to_v"), ("img_norm1", "img_norm2"), "img_mlp")
_TEXT = _Stream(("add_q_proj", "add_k_proj", "add_v_proj"), ("txt_norm1", "txt_norm2"), "txt_mlp")


def unfit(block: torch.nn.Module) -> str | None:
    """Why ``block`` does not take :func:`fused_block_forward` (None: it does)."""
    reason = unfit_class(block, "QwenImageTransformerBlock", _QWEN_IMAGE)
    if reason is not None:
        return reason
    if "forward" in block.__dict__:
        return "its forward was replaced already"
    if not all(plain_layer_norm(getattr(block, name, None)) for name in _NORMS):
        return "a norm is not a LayerNorm without weight or bias"
    return _unfit_stream(block, _IMAGE)


def _unfit_stream(block: torch.nn.Module, stream: _Stream) -> str | None:
    """Why ``stream`` of ``block`` cannot run in the kernels (None: it can)."""
    return unfit_fp8_projections(block.attn, stream.projections) or unfit_chosen(
        getattr(block, stream.feed_forward), stream.feed_forward
    )


def _stream_ready(
    block: torch.nn.Module, stream: _Stream, x: torch.Tensor, temb: torch.Tensor, index: torch.Tensor | None = None
) -> bool:
    """Whether ``stream`` (its input ``x``) can run in the kernels in this call: its products still plain
    FP8 linears, its feed-forward chose our kernel, its norms Qwen-Image's, and the kernels take ``x`` and its
    modulation (``temb`` ``[B, C]`` in ``x``'s dtype; with a per-token ``index``, ``[2B, C]``). Types,
    identities, attributes and tensor properties only (dynamo guards on them)."""
    from torchao.quantization.quantize_.workflows import Float8Tensor

    feed_forward = getattr(block, stream.feed_forward)
    return (
        all(plain_fp8_linear(getattr(block.attn, name, None), Float8Tensor) for name in stream.projections)
        and getattr(feed_forward, FP8_FEED_FORWARD_ATTRIBUTE, FP8_FEED_FORWARD_DEFAULT) == "fused"
        and gelu_feed_forward_ready(feed_forward, Float8Tensor)
        and all(plain_layer_norm(getattr(block, name)) for name in stream.norms)
        and temb.dim() == 2
        and temb.dtype == x.dtype
        and temb.shape[0] == x.shape[0] * (1 if index is None else 2)
        and block_glue.unsupported(x, (), (), index=index) is None
    )


def _attends_per_group(
    block: torch.nn.Module,
    image: torch.Tensor,
    text: torch.Tensor,
    text_mask: torch.Tensor | None,
    attention_kwargs: dict[str, Any],
) -> bool:
    """Whether fast mode's processor takes this call's attention per group, where it takes FP8 rows."""
    attn = block.attn
    lengths = attention_kwargs.get(TEXT_LENGTHS_KWARG)
    return (
        getattr(type(attn.processor).__call__, TAKES_FP8_ROWS, False)
        and qwen_per_group_lengths(attn, image, text, text_mask, attention_kwargs.get("attention_mask"), lengths)
        is not None
    )


def _first_half(
    block: torch.nn.Module,
    norm: torch.nn.LayerNorm,
    x: torch.Tensor,
    modulation: torch.Tensor,
    kernels: bool,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """One stream before attention: ``norm(x) * (1 + scale) + shift`` (``modulation`` is shift, scale, gate;
    with ``index``, per token), and the gate: with ``kernels`` FP8 rows and the gate's rows (as the kernels
    take them), otherwise as the class computes them (the gate ``[B, 1 or S, C]``)."""
    if not kernels:
        return block._modulate(norm(x), modulation, index)
    shift, scale, gate = modulation.chunk(3, dim=-1)
    data, scales = block_glue.modulated_layer_norm_fp8(x, norm.eps, scale, shift, index=index)
    return Fp8Rows(data, scales, x.dtype), gate


def _second_half(
    block: torch.nn.Module,
    norm: torch.nn.LayerNorm,
    feed_forward: torch.nn.Module,
    x: torch.Tensor,
    attention_output: torch.Tensor,
    gate: torch.Tensor,
    modulation: torch.Tensor,
    kernels: bool,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """One stream after attention: ``x + gate * attention_output``, then the feed-forward on its modulated
    norm, gated into it; in the kernels or, without ``kernels``, as the class computes it (``gate`` as
    :func:`_first_half` gave it for the same ``kernels`` and ``index``)."""
    if not kernels:
        x = x + gate * attention_output
        modulated, mlp_gate = block._modulate(norm(x), modulation, index)
        return x + mlp_gate * feed_forward(modulated)
    shift, scale, mlp_gate = modulation.chunk(3, dim=-1)
    return gated_feed_forward_fp8(x, attention_output, gate, norm.eps, scale, shift, mlp_gate, feed_forward, index)


def fused_block_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    modulate_index: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``QwenImageTransformerBlock.forward`` with its glue in :mod:`bcg_diffusion.kernels.block_glue`'s
    kernels (the module docstring); the class's forward where the call does not fit (a ``modulate_index``
    without ``zero_cond_t`` or the reverse, :func:`_attends_per_group`, the image stream's
    :func:`_stream_ready`). Returns ``(encoder_hidden_states, hidden_states)`` as the class does."""
    attention_kwargs = joint_attention_kwargs or {}
    index = modulate_index if self.zero_cond_t else None  # per-token modulation: Qwen-Image-Edit-2511's
    if (
        (modulate_index is None) == bool(self.zero_cond_t)
        or not isinstance(index, torch.Tensor | None)
        or not _attends_per_group(
            self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_kwargs
        )
        or not _stream_ready(self, _IMAGE, hidden_states, temb, index)
    ):
        return type(self).forward(
            self,
            hidden_states,
            encoder_hidden_states,
            encoder_hidden_states_mask,
            temb,
            image_rotary_emb,
            joint_attention_kwargs,
            modulate_index,
        )
    text_temb = temb.chunk(2, dim=0)[0] if self.zero_cond_t else temb  # the text keeps the step's modulation
    text_kernels = _stream_ready(self, _TEXT, encoder_hidden_states, text_temb)
    image_mod1, image_mod2 = self.img_mod(temb).chunk(2, dim=-1)
    text_mod1, text_mod2 = self.txt_mod(text_temb).chunk(2, dim=-1)
    image_input, image_gate = _first_half(self, self.img_norm1, hidden_states, image_mod1, True, index)
    text_input, text_gate = _first_half(self, self.txt_norm1, encoder_hidden_states, text_mod1, text_kernels)
    image_attention, text_attention = self.attn(
        hidden_states=image_input,
        encoder_hidden_states=text_input,
        encoder_hidden_states_mask=encoder_hidden_states_mask,
        image_rotary_emb=image_rotary_emb,
        **attention_kwargs,
    )
    hidden_states = _second_half(
        self, self.img_norm2, self.img_mlp, hidden_states, image_attention, image_gate, image_mod2, True, index
    )
    encoder_hidden_states = _second_half(
        self, self.txt_norm2, self.txt_mlp, encoder_hidden_states, text_attention, text_gate, text_mod2, text_kernels
    )
    if encoder_hidden_states.dtype == torch.float16:  # as the class clips, against overflow in fp16
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def patch_qwenimage_blocks(model: torch.nn.Module, patches: MethodPatches) -> int:
    """Give every block of ``model`` that fits (:func:`unfit`) the forward of :func:`fused_block_forward`,
    recorded in ``patches``; returns how many (:func:`bcg_diffusion.patches.block_glue.patch_blocks`)."""
    return patch_blocks(model, patches, unfit, fused_block_forward, "qwenimage fused block")
