"""The published pipelines' text encoders with random weights: ``python -m bench --pipeline NAME --text-encoders``.

By default :mod:`bench.published` feeds its pipelines random prompt embeddings and builds no text encoder. With
``--text-encoders`` each call encodes a prompt, as a user's call does, through the encoders these pipelines ship
with, at their checkpoints' configs (``weights="random-full"``) or tiny (``"tiny"``, for the CPU):

* FLUX.1-dev: CLIP ViT-L/14's text model (77 tokens, the pooled embedding) and T5-v1.1-XXL (512 tokens);
* FLUX.2 klein 4B: Qwen3-4B, three of its hidden layers side by side (512 tokens);
* Wan 2.1: UMT5-XXL (512 tokens), for the prompt and the negative prompt.

Every family gets the package's offline tokenizer (:mod:`bcg_diffusion.models.tokenizer`), not its own vocabulary:
the pipelines tokenize, pad to their fixed lengths and call, so the shapes and the work are the real ones.
Qwen-Image-Edit is not here: its encoder reads the input image through Qwen2.5-VL's processor, whose
configuration comes with the checkpoint.

Example (what ``bench.published.build(name, weights, device, text_encoders=True)`` does)::

    pipe = with_text_encoders(bench.published.build("flux2-klein", "tiny", cpu), "flux2-klein", "tiny", cpu)
    image = pipe(prompt="a red fox", **encoder_call_inputs("flux2-klein", "tiny"), height=64, width=64).images[0]
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import torch

__all__ = ["encoder_call_inputs", "with_text_encoders"]


def with_text_encoders(pipe: Any, name: str, weights: str, device: torch.device) -> Any:
    """``pipe`` (pipeline ``name`` of :data:`bench.published.PUBLISHED`, built without text encoders) rebuilt with
    its text encoders and tokenizers.

    ``weights``: ``"random-full"`` (the checkpoints' configs, random bfloat16 weights made on ``device``) or
    ``"tiny"`` (float32, sized to the tiny transformer's text width). Raises ValueError for a pipeline whose
    encoders are not built here (``PublishedCase.text_encoders`` False) or other weights."""
    from .published import PUBLISHED, encoded

    if not PUBLISHED[name].text_encoders:
        raise ValueError(
            f"--text-encoders builds the text encoders of {', '.join(encoded())}, not of {name} (its prompt "
            "embeddings stay random)"
        )
    if weights not in ("random-full", "tiny"):
        raise ValueError(f"text encoders are built with random-full or tiny weights, not {weights!r}")
    from bcg_diffusion.models.tokenizer import build_offline_tokenizer

    full = weights == "random-full"
    tokenizer = build_offline_tokenizer()
    components = {key: value for key, value in pipe.components.items() if value is not None}
    if name == "flux2-klein":
        components |= {"text_encoder": _qwen3(full, tokenizer, device), "tokenizer": tokenizer}
    elif name == "flux":
        clip_tokenizer = copy.deepcopy(tokenizer)
        clip_tokenizer.model_max_length = 77 if full else 16  # FluxPipeline pads CLIP's prompt to it
        width = pipe.transformer.config.joint_attention_dim
        components |= {
            "text_encoder": _clip(full, tokenizer, pipe.transformer.config.pooled_projection_dim, device),
            "tokenizer": clip_tokenizer,
            "text_encoder_2": _t5(full, tokenizer, width, device, umt5=False),
            "tokenizer_2": tokenizer,
        }
    else:
        width = pipe.transformer.config.text_dim
        components |= {"text_encoder": _t5(full, tokenizer, width, device, umt5=True), "tokenizer": tokenizer}
    rebuilt = type(pipe)(**components, **_init_flags(pipe))
    rebuilt.set_progress_bar_config(disable=True)
    return rebuilt


def encoder_call_inputs(name: str, weights: str) -> dict[str, Any]:
    """What a call of pipeline ``name`` with :func:`with_text_encoders`' encoders needs besides its prompt: nothing
    at full size; the tiny encoders' fewer tokens (and klein's two layers, where the real one reads three)."""
    if weights != "tiny":
        return {}
    if name == "flux2-klein":
        return {"text_encoder_out_layers": (1, 2), "max_sequence_length": 24}
    return {"max_sequence_length": 16 if name == "flux" else 24}


def _init_flags(pipe: Any) -> dict[str, Any]:
    """The pipeline's registered constructor values that are not components (klein's ``is_distilled``)."""
    return {key: pipe.config[key] for key in ("is_distilled",) if key in pipe.config}


def _random(factory: Any, name: str, device: torch.device, full: bool) -> torch.nn.Module:
    from .coverage_models import _random_model

    if full:
        return _random_model(factory, name, device)
    with torch.random.fork_rng():  # tiny weights of their own, whatever the caller's generator holds
        torch.manual_seed(0)
        return factory().to(device).eval()


def _qwen3(full: bool, tokenizer: Any, device: torch.device) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from bcg_diffusion.models.builders import _tiny_vocab_size, qwen3_4b_config

    # black-forest-labs/FLUX.2-klein-4B text_encoder: Qwen3-4B, loaded as a Qwen3ForCausalLM.
    config = qwen3_4b_config() if full else Qwen3Config(
        vocab_size=_tiny_vocab_size(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
    )  # fmt: skip
    return _random(partial(Qwen3ForCausalLM, config), "text_encoder", device, full)


def _clip(full: bool, tokenizer: Any, width: int, device: torch.device) -> torch.nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel

    from bcg_diffusion.models.builders import _tiny_vocab_size

    # black-forest-labs/FLUX.1-dev text_encoder/config.json (openai/clip-vit-large-patch14's text model).
    config = CLIPTextConfig(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768, bos_token_id=0, eos_token_id=2,
        pad_token_id=1,
    ) if full else CLIPTextConfig(
        vocab_size=_tiny_vocab_size(tokenizer), hidden_size=width, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )  # fmt: skip
    return _random(partial(CLIPTextModel, config), "text_encoder", device, full)


def _t5(full: bool, tokenizer: Any, width: int, device: torch.device, umt5: bool) -> torch.nn.Module:
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    from bcg_diffusion.models.builders import _tiny_vocab_size

    config_class, model_class = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    if full:
        # FLUX.1-dev text_encoder_2/config.json (google/t5-v1_1-xxl) and Wan2.1-T2V-14B-Diffusers
        # text_encoder/config.json (google/umt5-xxl): the same shape, UMT5 with its larger vocabulary and a
        # relative position bias in every layer.
        config = config_class(
            vocab_size=256384 if umt5 else 32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
            relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
            layer_norm_epsilon=1e-6, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
            decoder_start_token_id=0,
        )  # fmt: skip
    else:
        config = config_class(
            vocab_size=_tiny_vocab_size(tokenizer), d_model=width, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
            relative_attention_num_buckets=8,
        )  # fmt: skip
    return _random(partial(model_class, config), "text_encoder_2" if not umt5 else "text_encoder", device, full)
