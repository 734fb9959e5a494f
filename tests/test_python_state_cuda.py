"""Python state a graph read, on a GPU (marker: cuda): the four patterns that gave stale or wrong images.

Tiny Z-Image in bf16 with forward hooks on its main layers, in exact and fast mode. Each accelerated
call is compared byte for byte with the same call through ``eager(pipe)`` (the eager forwards in exact
mode; the compiled blocks without graphs in fast mode):

1. a tensor built from Python data and changed in place (``ids += 10``): right from the first call;
2. ``torch.tensor([module.shift], device=...)`` and 3. ``out + 0.05 * module.shift`` after the user
   changes ``shift``: the change is seen at the next pipeline call, the graphs that read it captured again;
4. a module-level list turned into a tensor, changed in place: watched as the constant's data; a
   module-level float rebound: not watchable, ``invalidate(pipe)`` is the way out (docs/limits.md).
"""

from __future__ import annotations

import pytest
import torch
from _cases import cuda_pipeline
from _checks import assert_graphs_ran

from bcg_diffusion import accelerate, eager, invalidate, restore, stats

pytestmark = pytest.mark.cuda

SHIFTS = [0.5, 0.25]  # a module-level list a hook turns into a tensor
SCALE = 1.0  # a module-level float a hook multiplies by


def _in_place_constant(module, args, out):
    ids = torch.tensor([0.0, 1.0, 2.0, 3.0], device=out.device, dtype=out.dtype)
    ids += 10
    return out + 0.01 * ids.sum()


def _tensor_from_attribute(module, args, out):
    return out + 0.05 * torch.tensor([module.shift], device=out.device, dtype=out.dtype)


def _attribute(module, args, out):
    return out + 0.05 * module.shift


def _globals(module, args, out):
    return (out + 0.05 * torch.tensor(SHIFTS, device=out.device, dtype=out.dtype).sum()) * SCALE


def _call(pipe):
    return pipe(
        "a red fox in the snow",
        height=64,
        width=64,
        num_inference_steps=3,
        guidance_scale=0.0,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="pt",
    ).images


def _check(pipe, before, captures):
    image = _call(pipe)
    report = assert_graphs_ran(pipe, before, captures=captures)
    with eager(pipe):
        reference = _call(pipe)
    assert torch.equal(image, reference), (image.float() - reference.float()).abs().max().item()
    return report, image


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_python_state_read_by_a_capture_is_never_replayed_stale(mode):
    global SCALE
    with cuda_pipeline("z-image", "tiny") as pipe:
        first, second = pipe.transformer.layers[0], pipe.transformer.layers[1]
        first.shift, second.shift = 0.0, 0.0
        for layer, hooks in ((first, (_in_place_constant, _tensor_from_attribute)), (second, (_attribute, _globals))):
            for hook in hooks:
                layer.register_forward_hook(hook)
        accelerate(pipe, mode=mode)
        try:
            report, image = _check(pipe, None, captures=True)  # 1: the in-place constant, from the first call
            report, _ = _check(pipe, report, captures=False)

            first.shift = 5.0  # 2: read through torch.tensor([shift])
            report, changed = _check(pipe, report, captures=True)
            assert not torch.equal(changed, image)
            second.shift = 3.0  # 3: read as a float
            report, _ = _check(pipe, report, captures=True)
            assert report["components"]["transformer"]["state_changes"] == 2

            SHIFTS[0] = 7.0  # 4: a module-level list changed in place: the data of a graph constant
            report, _ = _check(pipe, report, captures=True)
            SCALE = 2.0  # a module-level float rebound: no check sees it; invalidate(pipe) does the job
            invalidate(pipe)
            report, _ = _check(pipe, report, captures=True)
            _check(pipe, report, captures=False)
            print(f"\n{mode}: {stats(pipe)['components']['transformer']}")
        finally:
            SHIFTS[0], SCALE = 0.5, 1.0
            restore(pipe)
