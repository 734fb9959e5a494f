"""Object arguments inside real captures (marker: cuda): ``Flux2KleinKVPipeline``'s KV cache, and an
argument the signature cannot hold, used through eager breaks whose results choose the graph's path."""

from __future__ import annotations

import threading

import pytest
import torch
from _cases import flux2_klein_kv_case
from _checks import assert_graphs_ran
from test_object_arguments import Scorer, UsesScorer

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.core.graphs import GraphPool
from bcg_diffusion.core.runner import GraphRunner

pytestmark = pytest.mark.cuda


def test_flux2_klein_kv_captures_its_kv_cache_steps_byte_identical_to_eager():
    pipe, kwargs = flux2_klein_kv_case()
    pipe.to("cuda", torch.bfloat16)
    kwargs["prompt_embeds"] = kwargs["prompt_embeds"].to("cuda", torch.bfloat16)

    def call(seed):
        return pipe(**kwargs, num_inference_steps=4, generator=torch.Generator().manual_seed(seed), output_type="pt")

    accelerate(pipe)
    try:
        report = None
        for seed in (0, 1, 0):
            image = call(seed).images
            report = assert_graphs_ran(pipe, report, captures=report is None)
            with eager(pipe):
                assert torch.equal(image, call(seed).images), seed
        transformer = [s for s in stats(pipe)["signatures"] if s["component"] == "transformer"]
        assert len(transformer) == 2 and all(s["status"] == "captured" for s in transformer), transformer
    finally:
        restore(pipe)


class CudaScorer(Scorer):
    __slots__ = ()

    def __init__(self, scale):
        super().__init__(scale)
        self.offset = self.offset.cuda()


@torch.no_grad()
def test_an_unflattenable_argument_is_used_through_breaks_and_its_values_pick_the_path():
    model = UsesScorer()
    pool = GraphPool(torch.device("cuda"))
    runner = GraphRunner(model.forward, name="toy", pool=pool, lock=threading.RLock(), module=model)
    x = torch.randn(3, device="cuda")
    for scale in (1.0, 1.0, 2.0, 1.0, 2.0):
        assert torch.equal(runner(x, CudaScorer(scale)), model(x, CudaScorer(scale))), scale
    counters = runner.counters
    assert counters.captures == 1 and counters.eager_fallbacks == 0, counters
    assert counters.branches == 1 and counters.branch_switches >= 2, counters
    [record] = runner.records()
    assert record.breaks > 0 and record.status == "captured", record
