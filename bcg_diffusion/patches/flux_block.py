"""Fast mode: a FLUX single block's output projection without the joined row it reads.

FLUX.1's single blocks (``FluxSingleTransformerBlock``, 38 of them) run attention and an MLP side by side
on the same normed input, then join the attention output (3,072 wide) and the MLP's tanh GELU (12,288 wide)
with ``torch.cat`` before one output projection. Compiled, inductor makes the GELU and the join one kernel
that writes the whole joined row, 4.5 ms of a 131 ms bf16 step at 1024² (H100, run 179,
``bench.probes.probe_flux``). Two forwards avoid that row:

* **FP8** (:func:`fused_single_block_forward`, ``quantize="fp8"``): the output projection quantizes the
  joined row first. The patched forward hands the MLP's pre-activation and the attention output to
  :func:`bcg_diffusion.kernels.activation_fp8.gelu_fp8` (``head=``), which writes the joined float8 row and
  its scale in one pass, and runs torchao's product on them. Compiled, inductor spent 7.5 to 11.6 ms of a 95
  to 98 ms step there, computing the GELU twice (once for each row's largest magnitude, once to store it).
  FLUX.1-dev 1024², 28 steps, ``fast-fp8``: 2.854 → 2.645 s on an H100 (runs 162 and 169, each with eager at
  5.30 / 5.22 s).
* **bf16** (:func:`split_output_single_block_forward`): a product over a joined row is the sum of the
  products over its two parts, ``[a, m] @ W.T = a @ W_a.T + m @ W_m.T``. The patched forward computes the
  MLP's GELU in its product's cuBLASLt epilogue (as :mod:`bcg_diffusion.patches.gelu` does for diffusers'
  ``GELU``), then the output projection as two products into one result: the attention part with the bias,
  then the MLP part added to it (``addmm``'s ``beta=1``). No joined row and no GELU pass are written; the
  second product reads the first one's ``[tokens, 3,072]`` result once more.

Each changes rounding only (the GELU in float32 before rounding; the projection's sum rounded to bf16 once
between its parts), so it belongs to fast mode, whose contract is with its own compiled blocks, which run the
same forward. On a CPU the FP8 kernel runs its PyTorch reference, so there the FP8 forward gives the unpatched
block's bytes; the bf16 forward applies to CUDA weights only (a CPU's ``_addmm_activation`` computes the erf
GELU).

Applies to a block whose MLP activation is ``nn.GELU(approximate="tanh")`` and whose ``proj_mlp`` and
``proj_out`` are plain ``nn.Linear``: with a torchao row-wise FP8 ``proj_out``
(:func:`bcg_diffusion.patches.fp8_feed_forward.unfit_weight`) the FP8 forward, with both in bf16 or fp16 on
a CUDA GPU and with biases the bf16 one. :func:`unfit` and :func:`unfit_split` say why a block is left as it
is; ``patches.block_glue.choose(model, False)`` keeps both off. Checked again at every call (types and
identities, which dynamo turns into guards): a projection replaced (a LoRA layer) or an activation swapped
runs the class's forward.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.hooks import MethodPatches
from ..kernels.activation_fp8 import gelu_fp8, unsupported
from .block_glue import chosen_off, patch_blocks
from .fp8_feed_forward import linear_on_fp8, plain_fp8_linear, unfit_weight

__all__ = [
    "FLUX_SINGLE_BLOCK_PATCH",
    "FLUX_SPLIT_OUTPUT_PATCH",
    "fused_single_block_forward",
    "patch_flux_single_blocks",
    "patch_flux_split_outputs",
    "split_output_single_block_forward",
    "unfit",
    "unfit_split",
]

FLUX_SINGLE_BLOCK_PATCH = "FLUX FP8 single block: attention output and MLP GELU joined in one FP8 kernel"
FLUX_SPLIT_OUTPUT_PATCH = "FLUX single block: MLP GELU in its product's epilogue, output projection split at the join"
_FLUX = "diffusers.models.transformers.transformer_flux"


def _tanh_gelu(module: Any) -> bool:
    return type(module) is torch.nn.GELU and module.approximate == "tanh"


def _plain_half_linear(module: Any) -> bool:
    """Whether ``module`` is a plain ``nn.Linear`` with a bias and a bf16 or fp16 CUDA weight that is no
    tensor subclass (no quantized or wrapped weight)."""
    return (
        type(module) is torch.nn.Linear
        and module.bias is not None
        and type(module.weight) in (torch.Tensor, torch.nn.Parameter)
        and module.weight.dtype in (torch.bfloat16, torch.float16)
        and module.weight.is_cuda
    )


def _unfit_block(block: torch.nn.Module) -> str | None:
    """What both forwards need of ``block`` (None: it has it)."""
    if type(block).__name__ != "FluxSingleTransformerBlock" or type(block).__module__ != _FLUX:
        return "not diffusers' FluxSingleTransformerBlock"
    if chosen_off(block):
        return "chosen off (patches.block_glue.choose)"
    if not _tanh_gelu(getattr(block, "act_mlp", None)):
        return "its MLP activation is not nn.GELU(approximate='tanh')"
    for name in ("proj_mlp", "proj_out"):
        if type(getattr(block, name, None)) is not torch.nn.Linear:
            return f"its {name} is not a plain nn.Linear (LoRA or another wrapper)"
    return None


def unfit(block: torch.nn.Module) -> str | None:
    """Why ``block`` does not take :func:`fused_single_block_forward` (None: it does)."""
    return _unfit_block(block) or unfit_weight(block.proj_out.weight)


def unfit_split(block: torch.nn.Module) -> str | None:
    """Why ``block`` does not take :func:`split_output_single_block_forward` (None: it does)."""
    reason = _unfit_block(block)
    if reason is not None:
        return reason
    for name in ("proj_mlp", "proj_out"):
        if not _plain_half_linear(getattr(block, name)):
            return f"its {name} has no bias or no plain bf16 or fp16 weight on a CUDA GPU"
    return None


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


def split_output_single_block_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' ``FluxSingleTransformerBlock.forward`` (0.42) with the MLP's GELU in its product's epilogue
    and the output projection as two products, one per part of the row the class joins (the module
    docstring). Falls back to the class's forward where the block no longer fits (checked by type at each
    call)."""
    if not (_tanh_gelu(self.act_mlp) and _plain_half_linear(self.proj_mlp) and _plain_half_linear(self.proj_out)):
        return type(self).forward(
            self, hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs
        )
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    rows = norm_hidden_states.flatten(0, -2)
    mlp_hidden_states = torch._addmm_activation(self.proj_mlp.bias, rows, self.proj_mlp.weight.t(), use_gelu=True)
    joint_attention_kwargs = joint_attention_kwargs or {}
    attn_output = self.attn(
        hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb, **joint_attention_kwargs
    )

    weight = self.proj_out.weight
    width = attn_output.shape[-1]
    projected = torch.addmm(self.proj_out.bias, attn_output.flatten(0, -2), weight[:, :width].t())
    projected = torch.addmm(projected, mlp_hidden_states, weight[:, width:].t())
    hidden_states = residual + gate.unsqueeze(1) * projected.unflatten(0, residual.shape[:-1])
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)

    encoder_hidden_states, hidden_states = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return encoder_hidden_states, hidden_states


def patch_flux_single_blocks(model: torch.nn.Module, patches: MethodPatches) -> int:
    """Give every block of ``model`` that fits (:func:`unfit`) the forward of :func:`fused_single_block_forward`,
    recorded in ``patches``; returns how many (:func:`bcg_diffusion.patches.block_glue.patch_blocks`)."""
    return patch_blocks(model, patches, unfit, fused_single_block_forward, "flux fp8 single block")


def patch_flux_split_outputs(model: torch.nn.Module, patches: MethodPatches) -> int:
    """Give every block of ``model`` that fits (:func:`unfit_split`) the forward of
    :func:`split_output_single_block_forward`, recorded in ``patches``; returns how many
    (:func:`bcg_diffusion.patches.block_glue.patch_blocks`)."""
    return patch_blocks(model, patches, unfit_split, split_output_single_block_forward, "flux split single block")
