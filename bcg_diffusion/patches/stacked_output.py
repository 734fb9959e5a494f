"""Fast mode's Qwen-Image attention: the image stream's output projection run per CFG group, each group's
rows written into one output, instead of joining the groups' attention outputs first.

Fast mode attends each group of a CFG batch on its own
(:func:`bcg_diffusion.patches.attention.qwen_joint_attention_per_group`), so each group's attention output
is a tensor of its own. Joining their image rows for the output projection copied the whole image stream
(30–42 µs of a Qwen-Image block at 1024² with CFG, 2.8 ms in FP8 and 4.4 ms in bf16; runs 93, 94 and 145).
:func:`project_image` instead runs the projection on each group's rows as they lie, through
:func:`bcg_diffusion.kernels.stacked_linear.stacked_linear`, which writes every product into its rows of
one output.

Per attention module, :data:`STACKED_OUTPUT_ATTRIBUTE` chooses (:func:`choose`): ``"stacked"`` (the
default) or ``"joined"``, the concatenation, as before. The projection must be a plain ``nn.Linear`` with
plain weights and no hooks of its own (a LoRA layer, a quantized weight or a hook gets the concatenation
and the module's own call). A module attribute, so that the check of the Python state a graph read sees it
change. The choice never depends on the number of image tokens: fast mode compiles its blocks for any
number of them, and a threshold on it would compile a second variant of every block for the resolutions
on its other side.
"""

from __future__ import annotations

import torch

from ..kernels import stacked_linear

__all__ = ["STACKED_OUTPUT_ATTRIBUTE", "STACKED_OUTPUT_CHOICES", "choose", "plain_linear", "project_image"]

STACKED_OUTPUT_ATTRIBUTE = "_bcg_stacked_output"
STACKED_OUTPUT_CHOICES = ("stacked", "joined")


def choose(model: torch.nn.Module, choice: str) -> int:
    """Set ``choice`` (one of :data:`STACKED_OUTPUT_CHOICES`) on every Qwen-Image attention module of
    ``model`` (those with a text stream's projections), before or after ``accelerate``; returns how many.
    Raises ValueError for another choice.

    >>> choose(pipe.transformer, "joined")  # doctest: +SKIP
    """
    if choice not in STACKED_OUTPUT_CHOICES:
        raise ValueError(f"choice must be one of {STACKED_OUTPUT_CHOICES}, got {choice!r}")
    modules = [m for m in model.modules() if hasattr(m, "to_out") and getattr(m, "add_q_proj", None) is not None]
    for module in modules:
        setattr(module, STACKED_OUTPUT_ATTRIBUTE, choice)
    return len(modules)


def plain_linear(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` is exactly ``F.linear`` with its own weight and bias: a plain
    ``nn.Linear`` without hooks of its own or a forward replaced on it (accelerate's offload hooks replace
    it). Global module hooks are not looked at: the runner's search for ops a graph cannot hold installs
    some for its first run only, and the path must not change with it."""
    return (
        type(module) is torch.nn.Linear
        and "forward" not in module.__dict__
        and not (module._forward_hooks or module._forward_pre_hooks)
    )


def _stacks(attn: torch.nn.Module, projection: torch.nn.Module, parts: list[torch.Tensor]) -> bool:
    """Whether :func:`project_image` runs ``projection`` on ``parts`` through the stacked operator.
    Raises ValueError for a value of :data:`STACKED_OUTPUT_ATTRIBUTE` that is not one of the choices."""
    choice = getattr(attn, STACKED_OUTPUT_ATTRIBUTE, "stacked")
    if choice not in STACKED_OUTPUT_CHOICES:
        raise ValueError(
            f"{type(attn).__name__}.{STACKED_OUTPUT_ATTRIBUTE} is {choice!r}; expected one of {STACKED_OUTPUT_CHOICES}"
        )
    if choice == "joined" or len(parts) < 2 or not plain_linear(projection):
        return False
    return stacked_linear.unsupported(parts, projection.weight, projection.bias) is None


def project_image(attn: torch.nn.Module, parts: list[torch.Tensor]) -> torch.Tensor:
    """``attn.to_out`` (projection, then dropout) on the image rows ``parts`` (``[rows, C]`` each, in batch
    order), as ``[len(parts), rows, N]``: each part's product into its rows of one output where
    :func:`_stacks` says so, else the module's own call on their concatenation. Every part must have the
    same number of rows (each a batch row's image tokens)."""
    projection = attn.to_out[0]
    if _stacks(attn, projection, parts):
        output = stacked_linear.stacked_linear(parts, projection.weight, projection.bias)
        output = output.unflatten(0, (len(parts), -1))
    elif len(parts) == 1:
        output = projection(parts[0].unsqueeze(0))  # a view: one batch row's rows need no join
    else:
        output = projection(torch.stack(parts))
    if len(attn.to_out) > 1:
        output = attn.to_out[1](output)  # dropout
    return output
