"""Qwen-Image: device-side replacement for ``compute_text_seq_len_from_mask``.

The original builds its fallback length with ``torch.as_tensor(text_seq_len, device=...)``: a copy
from host memory, which cannot be captured (and costs a blocking copy per call). ``torch.full`` makes
the same int64 scalar with a fill kernel on the device. Everything else is unchanged.
"""

from __future__ import annotations

import torch

from . import FunctionPatch

__all__ = ["TEXT_SEQ_LEN_PATCH", "compute_text_seq_len_from_mask"]


def compute_text_seq_len_from_mask(
    encoder_hidden_states: torch.Tensor, encoder_hidden_states_mask: torch.Tensor | None
) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """Same contract and results as diffusers' function of that name, with no host-to-device copy.

    Returns ``(text_seq_len, per_sample_len, bool_mask)``: the padded text length (for RoPE), the
    per-sample index of the last active token plus one (``text_seq_len`` where no token is active),
    and the mask as bool. Raises ValueError when the mask's shape is not ``(batch, text_seq_len)``.
    """
    batch_size, text_seq_len = encoder_hidden_states.shape[:2]
    if encoder_hidden_states_mask is None:
        return text_seq_len, None, None
    if encoder_hidden_states_mask.shape[:2] != (batch_size, text_seq_len):
        raise ValueError(
            f"`encoder_hidden_states_mask` shape {encoder_hidden_states_mask.shape} must match "
            f"(batch_size, text_seq_len)=({batch_size}, {text_seq_len})."
        )
    if encoder_hidden_states_mask.dtype != torch.bool:
        encoder_hidden_states_mask = encoder_hidden_states_mask.to(torch.bool)
    device = encoder_hidden_states.device
    position_ids = torch.arange(text_seq_len, device=device, dtype=torch.long)
    active_positions = torch.where(encoder_hidden_states_mask, position_ids, position_ids.new_zeros(()))
    has_active = encoder_hidden_states_mask.any(dim=1)
    full_length = torch.full((), text_seq_len, device=device, dtype=torch.long)
    per_sample_len = torch.where(has_active, active_positions.max(dim=1).values + 1, full_length)
    return text_seq_len, per_sample_len, encoder_hidden_states_mask


TEXT_SEQ_LEN_PATCH = FunctionPatch(
    name="qwenimage.compute_text_seq_len_from_mask",
    modules=(
        "diffusers.models.transformers.transformer_qwenimage",
        "diffusers.models.controlnets.controlnet_qwenimage",
    ),
    attribute="compute_text_seq_len_from_mask",
    replacement=compute_text_seq_len_from_mask,
)
