"""Pipelines built from one set of components (``Img2ImgPipeline(**pipe.components)``), all accelerated.

A module shared by several pipelines is accelerated once: the pipelines that hold it share its graphs,
one pool and one lock. Every order of ``accelerate``, calls and ``restore`` must leave every pipeline
byte-identical to eager: on CPU in debug mode (the whole runner path), and with real graphs on a GPU
(the ``cuda`` parameters, bf16), in exact and fast mode.
"""

from __future__ import annotations

import inspect
import itertools
import warnings

import numpy as np
import PIL.Image
import pytest
import torch
from _checks import assert_graphs_ran
from diffusers import (
    QwenImageImg2ImgPipeline,
    QwenImageInpaintPipeline,
    QwenImagePipeline,
    ZImageImg2ImgPipeline,
    ZImageInpaintPipeline,
    ZImagePipeline,
)

from bcg_diffusion import BCGWarning, accelerate, eager, restore, stats
from bcg_diffusion.models import build_pipeline

FAMILIES = {
    "z-image": (ZImagePipeline, ZImageImg2ImgPipeline, ZImageInpaintPipeline),
    "qwen-image": (QwenImagePipeline, QwenImageImg2ImgPipeline, QwenImageInpaintPipeline),
}
SIZE = 32
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# Restoring the holders of shared modules one by one warns until the last (test_every_order_... checks that
# warning); where a test restores them all in turn only to clean up, the warnings are expected, not news.
RESTORING_ONE_BY_ONE = pytest.mark.filterwarnings(
    "ignore:bcg-diffusion. restore.*still holds:bcg_diffusion.BCGWarning"
)


def _image(seed: int) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)


def _mask() -> PIL.Image.Image:
    mask = np.zeros((SIZE, SIZE), dtype=np.uint8)
    mask[:, : SIZE // 2] = 255
    return PIL.Image.fromarray(mask)


def call(pipe, cfg: bool = False) -> torch.Tensor:
    """One deterministic call of any of the three pipelines (t2i, img2img, inpaint)."""
    parameters = inspect.signature(type(pipe).__call__).parameters
    kwargs = {"height": SIZE, "width": SIZE, "num_inference_steps": 3, "output_type": "pt"}
    if "true_cfg_scale" in parameters:  # Qwen-Image: true CFG needs a negative prompt
        kwargs.update(true_cfg_scale=4.0 if cfg else 1.0, negative_prompt="blurry" if cfg else None)
    else:
        kwargs.update(guidance_scale=4.0 if cfg else 0.0)
    if "image" in parameters:
        kwargs.update(image=_image(1), strength=0.7)
    if "mask_image" in parameters:
        kwargs["mask_image"] = _mask()
    out = pipe("a red fox in the snow", generator=torch.Generator("cpu").manual_seed(0), **kwargs)
    return out.images.detach().cpu()


def family(name: str, *, share=("transformer", "vae", "text_encoder"), device: str = "cpu", count: int = 3):
    """Text-to-image, img2img and inpaint pipelines (the first ``count`` of them); the modules in ``share``
    are the same objects in all, the others are built afresh for each (same random weights)."""
    dtype = torch.bfloat16 if device == "cuda" else None
    first = build_pipeline(name, "tiny", device=device, dtype=dtype)
    pipes = [first]
    for cls in FAMILIES[name][1:count]:
        own = build_pipeline(name, "tiny", device=device, dtype=dtype).components
        components = {key: (first.components[key] if key in share else value) for key, value in own.items()}
        pipes.append(cls(**components))
    for pipe in pipes:
        pipe.set_progress_bar_config(disable=True)
    return pipes


def _references(pipes):
    return [call(pipe) for pipe in pipes]


def _nothing_left(pipes) -> None:
    for pipe in pipes:
        for name in ("transformer", "vae", "text_encoder"):
            module = getattr(pipe, name)
            leftovers = [key for key in module.__dict__ if key in ("forward", "decode") or key.startswith("_bcg")]
            assert not leftovers, f"{type(pipe).__name__}.{name} still has {leftovers}"
        assert not hasattr(pipe, "_bcg_state")


def _options(device: str, mode: str = "exact") -> dict:
    return {"debug": device == "cpu", "mode": mode}


@RESTORING_ONE_BY_ONE
@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize(
    "device,mode", [("cpu", "exact"), *[pytest.param("cuda", m, marks=pytest.mark.cuda) for m in ("exact", "fast")]]
)
def test_three_pipelines_on_one_set_of_components_each_match_eager(name, device, mode):
    pipes = family(name, device=device)
    if mode == "exact":
        expected = _references(pipes)
        expected_cfg = [call(pipe, cfg=True) for pipe in pipes]
    for pipe in pipes:
        accelerate(pipe, **_options(device, mode))
    if mode == "fast":  # fast mode's reference: the same compiled blocks without graphs
        with eager(pipes[0]):  # the shared runners, bypassed for every pipeline that holds them
            expected = _references(pipes)
            expected_cfg = [call(pipe, cfg=True) for pipe in pipes]
    try:
        for pipe, image, image_cfg in zip(pipes, expected, expected_cfg):
            assert torch.equal(call(pipe), image), type(pipe).__name__
            assert torch.equal(call(pipe, cfg=True), image_cfg), type(pipe).__name__
            assert_graphs_ran(pipe)
        # One set of graphs: the transformer's runner is the same object in all three.
        assert len({id(p.transformer.forward.__bcg_runner__) for p in pipes}) == 1
        before = stats(pipes[0])
        assert before["shared_with"] == sorted(type(p).__name__ for p in pipes[1:])
        for pipe, image in zip(reversed(pipes), reversed(expected)):
            assert torch.equal(call(pipe), image), type(pipe).__name__
        assert_graphs_ran(pipes[0], before, captures=False)  # every signature was known: replays only
    finally:
        for pipe in pipes:
            restore(pipe)
        torch._dynamo.reset()
    _nothing_left(pipes)
    if mode == "exact":
        for pipe, image in zip(pipes, expected):
            assert torch.equal(call(pipe), image)


# Every order of accelerating two pipelines that share everything, calling them and restoring them.
_ORDERS = [
    (first, second, restored_first) for first, second in itertools.permutations((0, 1)) for restored_first in (0, 1)
]


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", _ORDERS, ids=lambda o: f"acc{o[0]}-acc{o[1]}-restore{o[2]}")
def test_every_order_of_accelerate_call_and_restore_stays_exact(name, device, order):
    pipes = family(name, device=device, count=2)  # text-to-image and img2img
    expected = _references(pipes)
    first, second, restored_first = order

    def check_all() -> None:
        for index, pipe in enumerate(pipes):
            assert torch.equal(call(pipe), expected[index]), f"pipeline {index} ({type(pipe).__name__})"

    accelerate(pipes[first], **_options(device))
    check_all()  # the second pipeline, not accelerated, already calls the shared graphs
    accelerate(pipes[second], **_options(device))
    check_all()
    for pipe in pipes:
        assert_graphs_ran(pipe)
    with pytest.warns(BCGWarning, match="still holds"):
        restore(pipes[restored_first])
    check_all()
    other = pipes[1 - restored_first]
    before = stats(other)
    assert torch.equal(call(other), expected[1 - restored_first])
    assert_graphs_ran(other, before, captures=False)  # the remaining pipeline keeps its graphs
    with warnings.catch_warnings():
        warnings.simplefilter("error", BCGWarning)  # the last holder restores without a warning
        restore(other)
    _nothing_left(pipes)
    check_all()


@RESTORING_ONE_BY_ONE
@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared", ["transformer", "vae", "text_encoder"])
def test_one_shared_module_is_right_in_both_pipelines(name, device, shared):
    pipes = family(name, share=(shared,), device=device, count=2)
    expected = _references(pipes)
    for pipe in pipes:
        accelerate(pipe, **_options(device))
    try:
        for _ in range(2):
            for pipe, image in zip(pipes, expected):
                assert torch.equal(call(pipe), image), type(pipe).__name__
        for pipe in pipes:
            assert_graphs_ran(pipe)
    finally:
        for pipe in pipes:
            restore(pipe)
    _nothing_left(pipes)


@RESTORING_ONE_BY_ONE
def test_sharing_pipelines_need_the_same_options():
    pipes = family("z-image", count=2)
    accelerate(pipes[0], debug=True)
    try:
        with pytest.raises(ValueError, match="same options"):
            accelerate(pipes[1], debug=True, warmup_runs=3)
        assert not hasattr(pipes[1], "_bcg_state")
        accelerate(pipes[1], debug=True, warmup=[(SIZE, SIZE)])  # a warm-up is an action, not an option
        assert stats(pipes[1])["captures"] > 0
    finally:
        for pipe in pipes:
            if hasattr(pipe, "_bcg_state"):
                restore(pipe)
    _nothing_left(pipes)


def test_pipelines_accelerated_apart_cannot_be_joined_by_a_third():
    a, b = build_pipeline("z-image", "tiny"), build_pipeline("z-image", "tiny")
    accelerate(a, debug=True)
    accelerate(b, debug=True)
    mixed = ZImageImg2ImgPipeline(**{**a.components, "vae": b.vae})
    try:
        with pytest.raises(ValueError, match="accelerated apart"):
            accelerate(mixed, debug=True)
    finally:
        restore(a)
        restore(b)


def test_a_relative_dropped_without_restore_releases_what_it_held():
    import gc

    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    expected = call(pipe)
    for _ in range(3):  # e.g. a server building a relative per request and forgetting it
        relative = ZImageImg2ImgPipeline(**pipe.components)
        accelerate(relative, debug=True)
        relative.set_progress_bar_config(disable=True)
        call(relative)
        del relative
        gc.collect()
    accelerate(pipe, debug=True)
    assert stats(pipe)["shared_with"] == []
    assert torch.equal(call(pipe), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BCGWarning)  # nothing else holds the modules any more
        restore(pipe)
    _nothing_left([pipe])
