"""Fast mode under FP8: a FLUX single block's attention output and MLP GELU joined in its output
projection's FP8 input, in one kernel.

FLUX.1's single blocks (``FluxSingleTransformerBlock``, 38 of them) run attention and an MLP side by side
on the same normed input, then join the attention output (3,072 wide) and the MLP's tanh GELU (12,288 wide)
with ``torch.cat`` before one output projection. With torchao's row-wise FP8 weights that projection
quantizes the joined row first. Compiled, inductor spends 7.5 to 11.6 ms of a 95 to 98 ms step at 1024²
there (H100, run 168, ``bench.probes.probe_flux``): it computes the GELU twice, once for each row's largest
magnitude and once to store it. The patched forward hands the MLP's pre-activation and the attention output
to :func:`bcg_diffusion.kernels.activation_fp8.gelu_fp8` (``head=``), which writes the joined float8 row and
its scale in one pass, and runs torchao's product on them: no joined bf16 tensor is made. FLUX.1-dev 1024²,
28 steps, ``fast-fp8``: 2.854 → 2.645 s on an H100 (runs 162 and 169, each with eager at 5.30 / 5.22 s).

The same steps as the unpatched block: on a CPU, where the kernel runs its PyTorch reference, the patched
forward gives the unpatched one's bytes (``torch.cat``, diffusers' GELU, torchao's row scale and cast). On a
GPU the kernel's float32 arithmetic is a few ulps from PyTorch's; fast mode allows it, its contract being
with its own compiled blocks, which run the same kernel.

Applies to a block whose MLP activation is ``nn.GELU(approximate="tanh")`` and whose output projection is a
plain ``nn.Linear`` holding a torchao row-wise FP8 weight
(:func:`bcg_diffusion.patches.fp8_feed_forward.unfit_weight`): :func:`unfit` says why a block is left as it
is. Checked again at every call (types and identities, which dynamo turns into guards): a projection
replaced (a LoRA layer) or an activation swapped runs the class's forward.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.hooks import MethodPatches
from ..kernels.activation_fp8 import gelu_fp8, unsupported
from .block_glue import chosen_off, patch_blocks
from .fp8_feed_forward import linear_on_fp8, plain_fp8_linear, unfit_weight

__all__ = ["FLUX_SINGLE_BLOCK_PATCH", "fused_single_block_forward", "patch_flux_single_blocks", "unfit"]

FLUX_SINGLE_BLOCK_PATCH = "FLUX FP8 single block: attention output and MLP GELU joined in one FP8 kernel"
_FLUX = "diffusers.models.transformers.transformer_flux"


def _tanh_gelu(module: Any) -> bool:
    return type(module) is torch.nn.GELU and module.approximate == "tanh"


def unfit(block: torch.nn.Module) -> str | None:
    """Why ``block`` does not take :func:`fused_single_block_forward` (None: it does)."""
    if type(block).__name__ != "FluxSingleTransformerBlock" or type(block).__module__ != _FLUX:
        return "not diffusers' FluxSingleTransformerBlock"
    if chosen_off(block):
        return "chosen off (patches.block_glue.choose)"
    if not _tanh_gelu(getattr(block, "act_mlp", None)):
        return "its MLP activation is not nn.GELU(approximate='tanh')"
    for name in ("proj_mlp", "proj_out"):
        if type(getattr(block, name, None)) is not torch.nn.Linear:
            return f"its {name} is not a plain nn.Linear (LoRA or another wrapper)"
    return unfit_weight(block.proj_out.weight)


def fused_single_block_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' ``FluxSingleTransformerBlock.forward`` (0.42) with the join of the attention output and the
    MLP's GELU, and the output projection's quantization of it, in :func:`gelu_fp8`. Falls back to the class's
    forward where the block no longer fits (checked by type and identity at each call)."""
    from torchao.quantization.quantize_.workflows import Float8Tensor

    fits = (
        _tanh_gelu(self.act_mlp)
        and type(self.proj_mlp) is torch.nn.Linear
        and plain_fp8_linear(self.proj_out, Float8Tensor)
    )
    if not fits:
        return type(self).forward(
            self, hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs
        )
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    mlp_hidden_states = self.proj_mlp(norm_hidden_states)
    joint_attention_kwargs = joint_attention_kwargs or {}
    attn_output = self.attn(
        hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb, **joint_attention_kwargs
    )

    fp8_dtype = self.proj_out.weight.qdata.dtype
    if unsupported(mlp_hidden_states, fp8_dtype, head=attn_output) is None:
        data, scale = gelu_fp8(mlp_hidden_states, fp8_dtype, head=attn_output)
        projected = linear_on_fp8(self.proj_out, data, scale, mlp_hidden_states.dtype)
    else:  # torchao quantizes the joined row itself, as in the class's forward
        projected = self.proj_out(torch.cat([attn_output, self.act_mlp(mlp_hidden_states)], dim=2))
    hidden_states = residual + gate.unsqueeze(1) * projected
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)

    encoder_hidden_states, hidden_states = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return encoder_hidden_states, hidden_states


def patch_flux_single_blocks(model: torch.nn.Module, patches: MethodPatches) -> int:
    """Give every block of ``model`` that fits (:func:`unfit`) the forward of :func:`fused_single_block_forward`,
    recorded in ``patches``; returns how many (:func:`bcg_diffusion.patches.block_glue.patch_blocks`)."""
    return patch_blocks(model, patches, unfit, fused_single_block_forward, "flux fp8 single block")
