"""Optional features, each a module of its own in the shape of :class:`~.base.Feature`.

:func:`~bcg_diffusion.accelerate` walks :data:`FEATURES` in order; that order is the order of their
hooks (context parallelism decides about the collectives before fast mode decides whether to compile,
step caching takes a cache's hooks off the blocks before they compile, quantization replaces
the weights before they compile (and before the fused query, key and value projections are built
from its originals, and before the GELU epilogue looks for plain projections and the
FP8 feed-forward for FP8 ones; the FP8 block glue needs the last two), FP8 attention and FlashAttention-4 mark the attention modules before they compile,
compiled blocks patch the attention processors before CFG batching asks what they accept, and a ControlNet's
blocks compile after them (its conditioning scale, applied after its graphs, wraps its runner's call); the text
encoder's layers compile after text trimming wraps its forward, as the VAE decoder does (the encoder follows
the decoder's choice); CFG across
GPUs wraps the transformer's call last, outside everything else; CFG batch hints wrap the prompt
encoder after text buckets pad its results).
"""

from __future__ import annotations

from .base import EXPERTS, Feature, Setup, Target, expert_target, expert_view
from .block_glue import FusedBlockGlue
from .cfg_batching import CfgBatchHints, CfgBatching
from .cfg_parallel import CfgParallel
from .compiled_blocks import CompiledBlocks
from .compiled_controlnet import CompiledControlNet
from .compiled_text_encoder import TEXT_ENCODER_FEATURES
from .context_parallel import ContextParallel
from .controlnet_scale import ControlNetScale
from .fa4_attention import Fa4Attention
from .fp8_attention import Fp8Attention
from .fp8_feed_forward import Fp8FeedForward
from .fused_qkv import FusedQkv
from .gelu_epilogue import GeluEpilogue
from .quantization import Quantization
from .step_caching import StepCaching
from .text_buckets import TextBuckets
from .text_trimming import TextTrimming
from .vae_decoder import FastVaeDecoder
from .vae_encoder import FastVaeEncoder

__all__ = ["EXPERTS", "FEATURES", "Feature", "Setup", "Target", "defaults", "expert_target", "expert_view"]

FEATURES: list[type[Feature]] = [
    ContextParallel,
    StepCaching,
    Quantization,
    FusedQkv,
    GeluEpilogue,
    Fp8FeedForward,
    FusedBlockGlue,
    Fp8Attention,
    Fa4Attention,
    CompiledBlocks,
    CompiledControlNet,
    ControlNetScale,
    CfgBatching,
    CfgParallel,
    TextTrimming,
    *TEXT_ENCODER_FEATURES,
    FastVaeDecoder,
    FastVaeEncoder,
    TextBuckets,
    CfgBatchHints,
]


def defaults() -> dict[str, object]:
    """Every feature's ``stats()`` keys with their values where it is not installed."""
    merged: dict[str, object] = {}
    for feature in FEATURES:
        merged.update(feature.defaults)
    return merged
