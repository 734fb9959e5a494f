"""GPU probe: two fast-mode kernel fixes measured side by side at full size, each against the code it replaces.

Answered (run 36, `bench/results/2026-12-01-h200/probe-norm-kernels-run36.log`): the group-norm patch takes Z-Image's decode from 20.1 to 12.6 ms at 512², per-slice RoPE a Qwen-Image block from 1105 to 1080 µs.

* Z-Image's VAE decode (random weights, 512² and 1024²) replayed from a CUDA graph, with PyTorch's
  group norm and with ``patches.group_norm`` (moments from one parallel reduction): time and the
  largest difference of the images.
* One Qwen-Image block (full width, random weights, batch 2 = a CFG pair of text lengths 13 and 6),
  compiled as fast mode compiles it, per-prompt attention with RoPE applied to the whole batch before
  slicing (the code before run 36) against RoPE applied per group slice (``patches.attention`` now):
  replayed time per block and the kernels that differ.

    python -m bench.probes.probe_norm_kernels
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.features import compiled_blocks as fast
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.patches import attention
from bcg_diffusion.patches.group_norm import patch_group_norms
from bcg_diffusion.patches.rope import QWEN_REAL_ROPE_PATCH, apply_rotary_emb_qwen
from bench.probes.probe_fast_floor import graph_replay_ms, kernel_table, random_block, section


def vae_group_norm() -> None:
    pipe = build_pipeline("z-image", "random-full", device="cuda", dtype=torch.bfloat16)
    vae = pipe.vae
    for size in (512, 1024):
        generator = torch.Generator("cuda").manual_seed(0)
        latents = torch.randn(1, 16, size // 8, size // 8, generator=generator, device="cuda", dtype=torch.bfloat16)

        def decode(latents: torch.Tensor = latents) -> torch.Tensor:
            return vae.decode(latents, return_dict=False)[0]

        with torch.no_grad():
            native_ms, native = graph_replay_ms(decode)
            native = native.clone()
            patches = MethodPatches()
            count = patch_group_norms(vae.decoder, patches)
            try:
                patched_ms, patched = graph_replay_ms(decode)
                diff = (patched.float() - native.float()).abs()
                images = [(t.float() / 2 + 0.5).clamp(0, 1) for t in (patched, native)]
                mse = F.mse_loss(*images).item()
                psnr = float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1 / mse)).item()
                print(
                    f"VAE {size}²: native group norm {native_ms:.2f} ms, patched ({count} norms) {patched_ms:.2f} ms; "
                    f"max abs diff {diff.max().item():.4f}, mean {diff.mean().item():.5f}, image PSNR {psnr:.1f} dB"
                )
                kernel_table(decode, f"VAE {size}² patched", top=8)
            finally:
                patches.undo()


def _rope_before_slicing(processor, attn, hidden_states, encoder_hidden_states, image_rotary_emb, text_lengths):
    """The per-group attention as it was up to run 35: RoPE on the whole batch, then per-group slices."""
    batch, text_tokens = encoder_hidden_states.shape[:2]
    image, text = attention.qwen_joint_projections(attn, hidden_states, encoder_hidden_states)
    image_freqs, text_freqs = image_rotary_emb
    image[:2] = [apply_rotary_emb_qwen(x, image_freqs, use_real=False) for x in image[:2]]
    text[:2] = [apply_rotary_emb_qwen(x, text_freqs, use_real=False) for x in text[:2]]
    rows = batch // len(text_lengths)
    image_outputs, text_outputs = [], []
    for group, length in enumerate(text_lengths):
        first, last = group * rows, (group + 1) * rows
        query, key, value = (torch.cat([t[first:last, :length], i[first:last]], dim=1) for t, i in zip(text, image))
        out = attention._diffusers_dispatch(query, key, value)
        out = out.flatten(2, 3).to(query.dtype)
        text_outputs.append(F.pad(out[:, :length], (0, 0, 0, text_tokens - length)))
        image_outputs.append(out[:, length:])
    return attn.to_out[0](torch.cat(image_outputs)), attn.to_add_out(torch.cat(text_outputs))


def qwen_block_ab() -> None:
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope, QwenImageTransformerBlock

    torch.manual_seed(0)
    with torch.device("cuda"):
        block = random_block(QwenImageTransformerBlock(dim=3072, num_attention_heads=24, attention_head_dim=128))
        rope = QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True)
    lengths, text_tokens = (13, 6), 13
    hidden = torch.randn(2, 1024, 3072, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(2, text_tokens, 3072, device="cuda", dtype=torch.bfloat16)
    mask = (torch.arange(text_tokens, device="cuda")[None] < torch.tensor(lengths, device="cuda")[:, None]).long()
    temb = torch.randn(2, 3072, device="cuda", dtype=torch.bfloat16)
    freqs = rope([(1, 32, 32)], max_txt_seq_len=text_tokens, device=torch.device("cuda"))
    kwargs = {"joint_attention_kwargs": {attention.TEXT_LENGTHS_KWARG: lengths}}

    processor_patches = MethodPatches()
    QWEN_REAL_ROPE_PATCH.apply(block, processor_patches)
    attention.QWEN_ATTENTION_PATCH.apply(block, processor_patches)
    holder = torch.nn.Module()
    holder.block = block
    holder._repeated_blocks = ["QwenImageTransformerBlock"]
    current = attention.qwen_joint_attention_per_group
    outputs = {}
    for name, per_group in (("rope before slicing", _rope_before_slicing), ("rope per slice (now)", current)):
        attention.qwen_joint_attention_per_group = per_group
        torch._dynamo.reset()
        compile_patches = MethodPatches()
        fast.compile_repeated_blocks(holder, compile_patches)
        try:

            def blocks(count: int = 10):
                for _ in range(count):
                    out = block(hidden, text, mask, temb, freqs, **kwargs)
                return out

            with torch.no_grad():
                times = [graph_replay_ms(blocks)[0] / 10 for _ in range(3)]
                outputs[name] = block(hidden, text, mask, temb, freqs, **kwargs)[1].float()
                print(f"Qwen-Image block, {name}: {statistics.median(times) * 1e3:.1f} us per block ({times})")
                kernel_table(lambda: blocks(1), f"block, {name}", top=14)
        finally:
            compile_patches.undo()
    attention.qwen_joint_attention_per_group = current
    first, second = outputs.values()
    print(f"image output max abs difference between the two: {(first - second).abs().max().item():.4f}")


if __name__ == "__main__":
    section("VAE group norm", vae_group_norm)
    section("Qwen-Image block A/B", qwen_block_ab)
