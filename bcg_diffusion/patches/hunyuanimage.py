"""HunyuanImage's transformer forward with its text tokens put in order by a sort instead of boolean selections.

diffusers' ``HunyuanImageTransformer2DModel.forward`` joins its two text streams (Qwen2.5-VL's and ByT5's) so
that each prompt's valid tokens come first: per prompt it concatenates ``byt5[mask_2]``, ``mllm[mask]``,
``byt5[~mask_2]`` and ``mllm[~mask]``. Those eight selections have data-dependent shapes, so a capture makes
each an automatic eager break, a host sync on every replay, and every new number of valid tokens is another
path through the graph. After eight prompt lengths the signature gives up and runs eagerly from then on
(``tests/test_hunyuanimage.py`` has a test that failed on that), and Cache-DiT's decisions on top reach that
limit within one call.

:func:`joined_text` gives the same tensors with fixed shapes: the two streams concatenated, then reordered by
a stable sort of "is padding" (valid tokens first, each group in its original order: ByT5's before Qwen's, as
diffusers' order has them). A gather moves values without arithmetic, so the result is byte-identical and
exact mode stays equal to eager. :func:`forward` is diffusers' forward with that one step replaced, written
against the code :mod:`bcg_diffusion.patches.followed` names (``"hunyuanimage joined text"``); where the
installed code differs, or gradient checkpointing is on, the original forward runs. The generic adapter hands
the runner this forward for a HunyuanImage transformer (:func:`runner_forward`); ``restore`` has nothing to
undo, the module itself is never changed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.utils import apply_lora_scale

from ..kernels.key_padding import visible_first_order
from .followed import installable

__all__ = ["JOINED_TEXT", "forward", "joined_text", "runner_forward"]

JOINED_TEXT = "hunyuanimage joined text"  # its name in bcg_diffusion.patches.followed.FOLLOWED
_CLASS = "HunyuanImageTransformer2DModel"  # compared by name first: diffusers' class is imported only for one


def joined_text(
    text: torch.Tensor, mask: torch.Tensor, text_2: torch.Tensor, mask_2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The joint text tokens and mask, ``[B, L_2 + L, D]`` and ``[B, L_2 + L]`` (bool): per prompt its valid ByT5
    tokens, its valid Qwen tokens, then its ByT5 padding and its Qwen padding, as diffusers' per-prompt
    concatenation orders them. ``mask`` and ``mask_2`` are boolean, True for a valid token."""
    tokens = torch.cat([text_2, text], dim=1)
    valid = torch.cat([mask_2, mask], dim=1)
    order = visible_first_order(valid)
    return torch.gather(tokens, 1, order.unsqueeze(-1).expand_as(tokens)), torch.gather(valid, 1, order)


def _unpatchify(module: torch.nn.Module, hidden_states: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """``[B, tokens, out_channels * prod(patch)]`` back to ``[B, out_channels, *sizes]`` (image or video)."""
    patch = tuple(module.config.patch_size)
    grid = [size // p for size, p in zip(sizes, patch)]
    channels = module.config.out_channels
    hidden_states = hidden_states.reshape(hidden_states.shape[0], *grid, channels, *patch)
    dims = len(grid)  # batch, channels, then each grid axis followed by its patch axis
    order = [0, dims + 1] + [axis for i in range(dims) for axis in (i + 1, dims + 2 + i)]
    return hidden_states.permute(*order).reshape(hidden_states.shape[0], channels, *sizes)


def _forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_attention_mask: torch.Tensor,
    timestep_r: torch.Tensor | None = None,
    encoder_hidden_states_2: torch.Tensor | None = None,
    encoder_attention_mask_2: torch.Tensor | None = None,
    guidance: torch.Tensor | None = None,
    attention_kwargs: dict[str, Any] | None = None,
    return_dict: bool = True,
) -> Any:
    if hidden_states.ndim not in (4, 5):
        raise ValueError(f"hidden_states must be a 4D or 5D tensor, got {hidden_states.shape}")
    sizes = tuple(hidden_states.shape[2:])
    image_rotary_emb = self.rope(hidden_states)
    encoder_attention_mask = encoder_attention_mask.bool()
    temb = self.time_guidance_embed(timestep, guidance=guidance, timestep_r=timestep_r)
    hidden_states = self.x_embedder(hidden_states)
    encoder_hidden_states = self.context_embedder(encoder_hidden_states, timestep, encoder_attention_mask)
    if self.context_embedder_2 is not None and encoder_hidden_states_2 is not None:
        encoder_hidden_states, encoder_attention_mask = joined_text(
            encoder_hidden_states,
            encoder_attention_mask,
            self.context_embedder_2(encoder_hidden_states_2),
            encoder_attention_mask_2.bool(),
        )
    attention_mask = F.pad(encoder_attention_mask, (hidden_states.shape[1], 0), value=True)[:, None, None]
    for block in (*self.transformer_blocks, *self.single_transformer_blocks):
        hidden_states, encoder_hidden_states = block(
            hidden_states,
            encoder_hidden_states,
            temb,
            attention_mask=attention_mask,
            image_rotary_emb=image_rotary_emb,
        )
    hidden_states = self.proj_out(self.norm_out(hidden_states, temb))
    hidden_states = _unpatchify(self, hidden_states, sizes)
    return Transformer2DModelOutput(sample=hidden_states) if return_dict else (hidden_states,)


# diffusers' own decorator, as on the original: LoRA scaling from attention_kwargs["scale"].
forward = apply_lora_scale("attention_kwargs")(_forward)


def runner_forward(method: Callable[..., Any]) -> Callable[..., Any]:
    """What the runner should call for ``method``: for diffusers' own ``HunyuanImageTransformer2DModel.forward``
    bound to a model, :func:`forward` bound to it (the original while gradient checkpointing is on); anything
    else, and everything where the installed forward is not the code :func:`forward` was written against (one
    warning then), as it is."""
    owner = getattr(method, "__self__", None)
    if type(owner).__name__ != _CLASS:
        return method
    from diffusers import HunyuanImageTransformer2DModel

    if getattr(method, "__func__", None) is not HunyuanImageTransformer2DModel.forward:
        return method  # a forward of someone else's (a subclass's, a library's wrapper): not what this mirrors
    if not installable(JOINED_TEXT, stacklevel=6):
        return method

    @functools.wraps(method)
    def joined_text_forward(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and owner.gradient_checkpointing:
            return method(*args, **kwargs)
        return forward(owner, *args, **kwargs)

    return joined_text_forward
