"""Text encoders (transformers): the attention-mask preparation as an eager break.

transformers builds the causal mask on the host's say-so: it looks at the padding mask
(``padding_mask.all()``, a host sync) to decide whether SDPA can run with ``is_causal`` and no mask,
and it takes another path while a CUDA stream is capturing (it treats capture like tracing and always
builds the mask). Captured as it is, an all-ones mask would give other kernels, and other bytes, than
eager. As an eager break, ``create_causal_mask`` runs outside the capture on every call: the decision
is eager's, and the graph segments after it are captured for that decision. The adapter also puts
the decision's input ("every token valid") in the signature (``PipelineAdapter.call_key``), so each
decision has a graph of its own instead of a replay that finds the other one
(:class:`~bcg_diffusion.BreakResultMismatch`). Outside a capture the break is a plain call, so the
patch changes nothing else.
"""

from __future__ import annotations

from typing import Any

from ..core.graphs import eager_break
from . import FunctionPatch

__all__ = ["CAUSAL_MASK_PATCH"]


@eager_break
def create_causal_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' ``create_causal_mask``, unchanged, run as an eager break during a capture."""
    from transformers import masking_utils

    return masking_utils.create_causal_mask(*args, **kwargs)


CAUSAL_MASK_PATCH = FunctionPatch(
    name="transformers.create_causal_mask (eager break)",
    modules=(
        "transformers.models.qwen3.modeling_qwen3",
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    ),
    attribute="create_causal_mask",
    replacement=create_causal_mask,
)
