"""The img2img and inpaint relatives of Qwen-Image and Z-Image: their calls, for the CPU and GPU tests.

Each relative is built from a text-to-image pipeline's components. They encode their input image
(and, inpainting, the masked image) with ``vae.encode``, which stays eager; ``strength`` cuts the
denoising steps run (with 3 steps: 0.6 runs 2, 1.0 runs 3), which changes no signature.
"""

from __future__ import annotations

import PIL.Image
import torch
from _cases import CASES
from diffusers import (
    QwenImageImg2ImgPipeline,
    QwenImageInpaintPipeline,
    ZImageImg2ImgPipeline,
    ZImageInpaintPipeline,
)

# relative -> (text-to-image pipeline whose components it takes, its class, the cases it runs)
RELATIVES = {
    "qwen-image-img2img": ("qwen-image", QwenImageImg2ImgPipeline, ("no_cfg", "true_cfg")),
    "qwen-image-inpaint": ("qwen-image", QwenImageInpaintPipeline, ("no_cfg", "true_cfg", "mask_two_lengths")),
    "z-image-img2img": ("z-image", ZImageImg2ImgPipeline, ("no_cfg", "cfg")),
    "z-image-inpaint": ("z-image", ZImageInpaintPipeline, ("no_cfg", "cfg")),
}
STRENGTHS = (0.6, 1.0)
STEPS = 3
STEPS_RUN = {0.6: 2, 1.0: 3}  # diffusers' get_timesteps: int(STEPS - STEPS * strength) steps are skipped
MASKS = ("left_half", "centre_square")


def image(height, width):
    """A deterministic RGB image of exactly the call's size (Z-Image's relatives do not resize it)."""
    pixels = torch.rand(height, width, 3, generator=torch.Generator("cpu").manual_seed(height * 1000 + width))
    return PIL.Image.fromarray((pixels * 255).round().to(torch.uint8).numpy())


def mask(kind, height, width):
    """White (1) is repainted: the left half as a PIL image, a centred square as a (1, 1, H, W) tensor."""
    if kind == "left_half":
        pixels = torch.zeros(height, width, dtype=torch.uint8)
        pixels[:, : width // 2] = 255
        return PIL.Image.fromarray(pixels.numpy(), mode="L")
    side = min(height, width) // 2
    top, left = (height - side) // 2, (width - side) // 2
    square = torch.zeros(1, 1, height, width)
    square[..., top : top + side, left : left + side] = 1.0
    return square


def run(pipe, base, case, *, strength, height, width, output_type="pt", mask_kind=None, seed=0, **overrides):
    """One call of a relative; returns the image (``"pt"``) or the latents as a CPU tensor."""
    kwargs = {k: (list(v) if isinstance(v, list) else v) for k, v in CASES[base][case].items()}
    kwargs.update(overrides)
    if mask_kind is not None:
        kwargs["mask_image"] = mask(mask_kind, height, width)
    out = pipe(
        **kwargs,
        image=image(height, width),
        strength=strength,
        height=height,
        width=width,
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type=output_type,
    )
    return out.images.detach().cpu()


def calls(relative, resolutions):
    """Both cases at every strength and resolution; the output type and (inpainting) the mask vary with
    them so that every pair of values of any two of these meets (an 8-call pairwise design). A third
    case (Qwen-Image's prompts of two lengths, the masked path) runs once per resolution and strength.
    CFG modes alternate call by call and resolutions every few calls, so captures interleave with
    replays."""
    _, cls, cases = RELATIVES[relative]
    inpaint = cls.__name__.endswith("InpaintPipeline")
    design = []
    for s, strength in enumerate(STRENGTHS):
        for r, (height, width) in enumerate(resolutions):
            for c, case in enumerate(cases):
                if c >= 2 and s != r:
                    continue
                output_type = ("pt", "latent")[(s + r + c) % 2]
                mask_kind = MASKS[(s + r) % 2] if inpaint else None
                design.append((case, strength, height, width, output_type, mask_kind))
    return design


def call(pipe, base, one):
    """``run`` for one entry of :func:`calls`."""
    case, strength, height, width, output_type, mask_kind = one
    return run(
        pipe, base, case, strength=strength, height=height, width=width, output_type=output_type, mask_kind=mask_kind
    )
