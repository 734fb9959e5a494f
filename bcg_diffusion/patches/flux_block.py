"""Fast mode: FLUX.1's blocks with their glue in kernels of ours.

**The double blocks' glue under FP8** (``FluxTransformerBlock``, 19 of them; :func:`fused_double_block_forward`).
Its arithmetic is Qwen-Image's: ``AdaLayerNormZero`` (a LayerNorm without weight or bias, ``1 + scale`` and
``shift``), plain gates, a gated residual after attention and after the feed-forward. So the image stream
runs in :mod:`bcg_diffusion.kernels.block_glue`'s Qwen-Image kernels: the modulated norm writes the FP8 rows
that attention's query, key and value products read (fast mode's FLUX processor takes them,
:mod:`bcg_diffusion.patches.flux_attention`), the attention's gated residual writes the feed-forward's FP8
input, and the feed-forward's gated residual ends the block. The text stream's norm before attention stays the
class's (its projections are bf16 by default); after attention it runs in the kernels where its feed-forward
is FP8. The single blocks' norm writes its FP8 rows the same way, for their query, key, value and MLP
products. Compiled, inductor ran those norms with their FP8 rows in 3.3 ms and the residuals in 1.6 ms of a
92 ms ``fast-fp8`` step at 1024² (H100, run 179). FLUX.1-dev 1024², 28 steps, ``fast-fp8``: 2.569 s against
2.776 s with inductor's glue in every FLUX block, the joined row below included (H100, run 189). Applies where
:func:`unfit_double` says None, and at each call where the processor takes FP8 rows and the projections are
still plain FP8 linears.

**The single blocks' joined row.** FLUX.1's single blocks (``FluxSingleTransformerBlock``, 38 of them) run
attention and an MLP side by side on the same normed input, then join the attention output (3,072 wide) and
the MLP's tanh GELU (12,288 wide) with ``torch.cat`` before one output projection. Compiled, inductor makes the
GELU and the join one kernel that writes the whole joined row, 4.5 ms of a 131 ms bf16 step at 1024² (H100,
run 179, ``bench.probes.probe_flux``). Two forwards avoid that row:

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
  second product reads the first one's ``[tokens, 3,072]`` result once more. FLUX.1-dev 1024², 28 steps,
  ``fast``: 3.640 and 3.656 s against 3.713 and 3.703 s with the class's forward (H100, runs 189 and 193).

Each changes rounding only (the GELU in float32 before rounding; the projection's sum rounded to bf16 once
between its parts), so it belongs to fast mode, whose contract is with its own compiled blocks, which run the
same forward. On a CPU the FP8 kernel runs its PyTorch reference, so there the FP8 forward gives the unpatched
block's bytes; the bf16 forward applies to CUDA weights only (a CPU's ``_addmm_activation`` computes the erf
GELU).

Applies to a single block whose MLP activation is ``nn.GELU(approximate="tanh")`` and whose ``proj_mlp`` and
``proj_out`` are plain ``nn.Linear``: with a torchao row-wise FP8 ``proj_out``
(:func:`bcg_diffusion.patches.fp8_feed_forward.unfit_weight`) the FP8 forward, with both in bf16 or fp16 on
a CUDA GPU and with biases the bf16 one. :func:`unfit` and :func:`unfit_split` say why a block is left as it
is; ``patches.block_glue.choose(model, False)`` keeps every forward of this module off. Checked again at
every call (types and identities, which dynamo turns into guards): a projection replaced (a LoRA layer) or an
activation swapped runs the class's forward.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.hooks import MethodPatches
from ..kernels import block_glue
from ..kernels.activation_fp8 import gelu_fp8, unsupported
from .attention import TAKES_FP8_ROWS
from .block_glue import gated_feed_forward_fp8, patch_blocks, plain_layer_norm, unfit_class
from .fp8_feed_forward import (
    FP8_FEED_FORWARD_ATTRIBUTE,
    FP8_FEED_FORWARD_DEFAULT,
    Fp8Rows,
    gelu_feed_forward_ready,
    linear_on_fp8,
    plain_fp8_linear,
    unfit_chosen,
    unfit_fp8_projections,
    unfit_weight,
)

__all__ = [
    "FLUX_DOUBLE_BLOCK_PATCH",
    "FLUX_SINGLE_BLOCK_PATCH",
    "FLUX_SPLIT_OUTPUT_PATCH",
    "fused_double_block_forward",
    "fused_single_block_forward",
    "patch_flux_double_blocks",
    "patch_flux_single_blocks",
    "patch_flux_split_outputs",
    "split_output_single_block_forward",
    "unfit",
    "unfit_double",
    "unfit_split",
]

FLUX_SINGLE_BLOCK_PATCH = (
    "FLUX FP8 single block: its norm and modulation, and its attention output and MLP GELU joined, in FP8 kernels"
)
FLUX_DOUBLE_BLOCK_PATCH = "FLUX FP8 double block: norms, modulation, gated residuals and FP8 inputs in three kernels"
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
    reason = unfit_class(block, "FluxSingleTransformerBlock", _FLUX)
    if reason is not None:
        return reason
    if not _tanh_gelu(getattr(block, "act_mlp", None)):
        return "its MLP activation is not nn.GELU(approximate='tanh')"
    for name in ("proj_mlp", "proj_out"):
        if type(getattr(block, name, None)) is not torch.nn.Linear:
            return f"its {name} is not a plain nn.Linear (LoRA or another wrapper)"
    return None


def _plain_ada_norm(norm: Any) -> bool:
    """Whether ``norm`` is diffusers' ``AdaLayerNormZero`` (without its own timestep embedding) or
    ``AdaLayerNormZeroSingle``, normalizing with a plain LayerNorm: the modulation our kernels apply."""
    name = type(norm).__name__
    if name not in ("AdaLayerNormZero", "AdaLayerNormZeroSingle"):
        return False
    return (name == "AdaLayerNormZeroSingle" or norm.emb is None) and plain_layer_norm(getattr(norm, "norm", None))


def _rows_ready(
    norm: torch.nn.Module,
    linears: tuple[torch.nn.Module, ...],
    attn: torch.nn.Module,
    x: torch.Tensor,
    temb: torch.Tensor,
    float8_tensor: type,
) -> bool:
    """Whether a stream ``x`` can enter attention as FP8 rows from our norm kernel in this call: its ``norm``
    FLUX's modulated LayerNorm, ``linears`` (beside attention's query, key and value, which read the same rows)
    and those projections plain FP8 linears, the processor one that takes rows, and the kernels taking ``x``
    and ``temb`` (``[B, C]`` in ``x``'s dtype). Types, identities, attributes and tensor properties only
    (dynamo guards on them)."""
    projections = (attn.to_q, attn.to_k, attn.to_v, *linears)
    return (
        _plain_ada_norm(norm)
        and all(plain_fp8_linear(linear, float8_tensor) for linear in projections)
        and not attn.fused_projections
        and getattr(type(attn.processor).__call__, TAKES_FP8_ROWS, False)
        and temb.dim() == 2
        and temb.dtype == x.dtype
        and temb.shape[0] == x.shape[0]
        and block_glue.unsupported(x, (), ()) is None
    )


def _feed_forward_ready(feed_forward: torch.nn.Module, norm: Any, float8_tensor: type) -> bool:
    """Whether a stream's feed-forward can run on FP8 rows from our residual kernel: it chose fast mode's FP8
    kernel and still is diffusers' tanh-GELU ``FeedForward`` of plain FP8 linears, its norm FLUX's."""
    return (
        getattr(feed_forward, FP8_FEED_FORWARD_ATTRIBUTE, FP8_FEED_FORWARD_DEFAULT) == "fused"
        and gelu_feed_forward_ready(feed_forward, float8_tensor)
        and plain_layer_norm(norm)
    )


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


def _gated_split(
    residual: torch.Tensor, gate: torch.Tensor, projected: torch.Tensor, text_seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The end of diffusers' ``FluxSingleTransformerBlock.forward`` (0.42): the gated residual of the projected
    joined row, clipped to float16's range in float16, split back into the text and image streams."""
    hidden_states = residual + gate.unsqueeze(1) * projected
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


def fused_single_block_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' ``FluxSingleTransformerBlock.forward`` (0.42) with the join of the attention output and the
    MLP's GELU, and the output projection's quantization of it, in :func:`gelu_fp8`; where the processor takes
    FP8 rows (:func:`_rows_ready`), the modulated norm writing them in ``modulated_layer_norm_fp8``. Falls back
    to the class's forward where the block no longer fits (checked by type and identity at each call)."""
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
    if _rows_ready(self.norm, (self.proj_mlp,), self.attn, hidden_states, temb, Float8Tensor):
        shift, scale, gate = self.norm.linear(self.norm.silu(temb)).chunk(3, dim=1)
        rows = Fp8Rows(
            *block_glue.modulated_layer_norm_fp8(hidden_states, self.norm.norm.eps, scale, shift), hidden_states.dtype
        )
        mlp_hidden_states = linear_on_fp8(self.proj_mlp, *rows)
    else:
        rows, gate = self.norm(hidden_states, emb=temb)
        mlp_hidden_states = self.proj_mlp(rows)
    joint_attention_kwargs = joint_attention_kwargs or {}
    attn_output = self.attn(hidden_states=rows, image_rotary_emb=image_rotary_emb, **joint_attention_kwargs)

    fp8_dtype = self.proj_out.weight.qdata.dtype
    if unsupported(mlp_hidden_states, fp8_dtype, head=attn_output) is None:
        data, scale = gelu_fp8(mlp_hidden_states, fp8_dtype, head=attn_output)
        projected = linear_on_fp8(self.proj_out, data, scale, mlp_hidden_states.dtype)
    else:  # torchao quantizes the joined row itself, as in the class's forward
        projected = self.proj_out(torch.cat([attn_output, self.act_mlp(mlp_hidden_states)], dim=2))
    return _gated_split(residual, gate, projected, text_seq_len)


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
    return _gated_split(residual, gate, projected.unflatten(0, residual.shape[:-1]), text_seq_len)


def patch_flux_single_blocks(model: torch.nn.Module, patches: MethodPatches) -> int:
    """Give every block of ``model`` that fits (:func:`unfit`) the forward of :func:`fused_single_block_forward`,
    recorded in ``patches``; returns how many (:func:`bcg_diffusion.patches.block_glue.patch_blocks`)."""
    return patch_blocks(model, patches, unfit, fused_single_block_forward, "flux fp8 single block")


def patch_flux_split_outputs(model: torch.nn.Module, patches: MethodPatches) -> int:
    """Give every block of ``model`` that fits (:func:`unfit_split`) the forward of
    :func:`split_output_single_block_forward`, recorded in ``patches``; returns how many
    (:func:`bcg_diffusion.patches.block_glue.patch_blocks`)."""
    return patch_blocks(model, patches, unfit_split, split_output_single_block_forward, "flux split single block")


def unfit_double(block: torch.nn.Module) -> str | None:
    """Why ``block`` does not take :func:`fused_double_block_forward` (None: it does)."""
    reason = unfit_class(block, "FluxTransformerBlock", _FLUX)
    if reason is not None:
        return reason
    if "forward" in block.__dict__:
        return "its forward was replaced already"
    if not _plain_ada_norm(getattr(block, "norm1", None)) or not plain_layer_norm(getattr(block, "norm2", None)):
        return "its image norms are not FLUX's LayerNorms without weight or bias"
    return unfit_fp8_projections(block.attn, ("to_q", "to_k", "to_v")) or unfit_chosen(block.ff, "ff")


def _context_half(
    self: torch.nn.Module,
    x: torch.Tensor,
    attention_output: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    mlp_gate: torch.Tensor,
    kernels: bool,
) -> torch.Tensor:
    """The text stream after attention, in the kernels or, without ``kernels``, as the class computes it."""
    if not kernels:
        x = x + gate.unsqueeze(1) * attention_output
        modulated = self.norm2_context(x) * (1 + scale[:, None]) + shift[:, None]
        return x + mlp_gate.unsqueeze(1) * self.ff_context(modulated)
    return gated_feed_forward_fp8(
        x, attention_output, gate, self.norm2_context.eps, scale, shift, mlp_gate, self.ff_context
    )


def fused_double_block_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' ``FluxTransformerBlock.forward`` (0.42) with the image stream's glue in
    :mod:`bcg_diffusion.kernels.block_glue`'s kernels (Qwen-Image's, the same arithmetic): its modulated
    norm writing the FP8 rows that attention's query, key and value read, the attention's gated residual
    with the feed-forward's norm and FP8 input, and the feed-forward's gated residual. The text stream's
    norm before attention stays the class's (its projections are bf16 by default); after attention it runs in
    the kernels where its feed-forward is FP8. Falls back to the class's forward where the block no longer
    fits (checked by type and identity at each call)."""
    from torchao.quantization.quantize_.workflows import Float8Tensor

    if not (
        _rows_ready(self.norm1, (), self.attn, hidden_states, temb, Float8Tensor)
        and _feed_forward_ready(self.ff, self.norm2, Float8Tensor)
    ):
        return type(self).forward(
            self, hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs
        )
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1.linear(self.norm1.silu(temb)).chunk(
        6, dim=1
    )
    data, scales = block_glue.modulated_layer_norm_fp8(hidden_states, self.norm1.norm.eps, scale_msa, shift_msa)
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
        encoder_hidden_states, emb=temb
    )
    joint_attention_kwargs = joint_attention_kwargs or {}
    attn_output, context_attn_output = self.attn(
        hidden_states=Fp8Rows(data, scales, hidden_states.dtype),
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )

    hidden_states = gated_feed_forward_fp8(
        hidden_states, attn_output, gate_msa, self.norm2.eps, scale_mlp, shift_mlp, gate_mlp, self.ff
    )

    text_kernels = (
        _feed_forward_ready(self.ff_context, self.norm2_context, Float8Tensor)
        and block_glue.unsupported(encoder_hidden_states, (), ()) is None
    )
    encoder_hidden_states = _context_half(
        self,
        encoder_hidden_states,
        context_attn_output,
        c_gate_msa,
        c_shift_mlp,
        c_scale_mlp,
        c_gate_mlp,
        text_kernels,
    )
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def patch_flux_double_blocks(model: torch.nn.Module, patches: MethodPatches) -> int:
    """Give every block of ``model`` that fits (:func:`unfit_double`) the forward of
    :func:`fused_double_block_forward`, recorded in ``patches``; returns how many
    (:func:`bcg_diffusion.patches.block_glue.patch_blocks`)."""
    return patch_blocks(model, patches, unfit_double, fused_double_block_forward, "flux fp8 double block")
