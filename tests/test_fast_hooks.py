"""Fast mode's result must not depend on what happened to the pipeline earlier (CPU, debug mode).

Hooks inside a compiled block (sequential CPU offload puts accelerate's on every leaf module) cannot
be compiled: the block then runs its eager forward for that call, with a warning, and once the hooks
are gone the same compiled blocks run again. Before, the first such call retired the compiled blocks
for good, so every later image was eager's, not fast mode's.
"""

from __future__ import annotations

import pytest
import torch
from _checks import assert_graphs_ran, needs_compiler
from accelerate.hooks import AlignDevicesHook, ModelHook, add_hook_to_module, remove_hook_from_module

from bcg_diffusion import BCGWarning, accelerate, eager, restore, stats
from bcg_diffusion.features.compiled_blocks import hooked_submodules
from bcg_diffusion.models import build_pipeline


def _call(pipe) -> torch.Tensor:
    out = pipe(
        "a red fox",
        height=32,
        width=32,
        num_inference_steps=2,
        guidance_scale=0.0,
        output_type="pt",
        generator=torch.Generator("cpu").manual_seed(0),
    )
    return out.images


def _leaves(pipe) -> list[torch.nn.Module]:
    return [m for block in pipe.transformer.layers for m in block.modules() if not list(m.children())]


def test_hooked_submodules_names_hooks_inside_a_block_only():
    pipe = build_pipeline("z-image", "tiny")
    block = pipe.transformer.layers[0]
    assert hooked_submodules(block) == []
    add_hook_to_module(block, ModelHook())  # on the block itself: wraps the compiled forward from outside
    assert hooked_submodules(block) == []
    inner = next(name for name, m in block.named_modules() if name and not list(m.children()))
    add_hook_to_module(block.get_submodule(inner), ModelHook())
    assert hooked_submodules(block) == [inner]
    remove_hook_from_module(block, recurse=True)
    assert hooked_submodules(block) == []


@needs_compiler
@pytest.mark.heavy  # compiles with inductor on CPU
def test_fast_mode_gives_its_own_image_again_once_hooks_are_gone():
    torch._dynamo.reset()
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    accelerate(pipe, mode="fast", debug=True)
    try:
        fast_image = _call(pipe)
        before = assert_graphs_ran(pipe)
        with eager(pipe):
            assert torch.equal(_call(pipe), fast_image)  # fast mode's reference: its compiled blocks
        for leaf in _leaves(pipe):  # what enable_sequential_cpu_offload does to every leaf (minus the offload)
            add_hook_to_module(leaf, AlignDevicesHook(execution_device=torch.device("cpu"), io_same_device=True))
        with pytest.warns(BCGWarning, match="carry hooks"):
            _call(pipe)
        hooked = stats(pipe)
        assert hooked["eager_block_calls"] > 0 and hooked["compile_failure"] is None, hooked["compile_failure"]
        for leaf in _leaves(pipe):
            remove_hook_from_module(leaf)
        again = _call(pipe)
        report = stats(pipe)
        assert report["compile_failure"] is None
        assert report["eager_block_calls"] == hooked["eager_block_calls"]  # compiled again, not eager
        assert torch.equal(again, fast_image)
        assert_graphs_ran(pipe, before)
    finally:
        restore(pipe)
        torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.parametrize("offload", ["model", "sequential"])
def test_fast_mode_after_offload_on_the_gpu(offload):
    """diffusers' own offloads after ``accelerate``: model offload keeps the compiled blocks (weights move,
    the code does not); sequential offload hooks every leaf, so those calls run eager blocks, with a
    warning; once the offload is removed, fast mode's image is the one from before."""
    torch._dynamo.reset()
    pipe = build_pipeline("z-image", "tiny", device="cuda", dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    accelerate(pipe, mode="fast")
    try:
        fast_image = _call(pipe)
        assert torch.equal(_call(pipe), fast_image)
        assert_graphs_ran(pipe)
        getattr(pipe, f"enable_{offload}_cpu_offload")()
        if offload == "sequential":
            with pytest.warns(BCGWarning, match="carry hooks"):
                _call(pipe)
        else:
            assert torch.equal(_call(pipe), fast_image)
        assert stats(pipe)["compile_failure"] is None
        pipe.remove_all_hooks()
        pipe.to("cuda")
        before = stats(pipe)
        assert torch.equal(_call(pipe), fast_image)
        assert torch.equal(_call(pipe), fast_image)
        assert_graphs_ran(pipe, before)
        assert stats(pipe)["compile_failure"] is None
    finally:
        restore(pipe)
        torch._dynamo.reset()
