"""The hostile-op finder on small modules, one kind of graph-hostile operation each (CPU).

Ops are classified by what they do on a GPU, so the CPU finds them too; copies between host and GPU
need a GPU, and their classification is checked on the op's arguments directly.
"""

from __future__ import annotations

import pytest
import torch
from _cases import run_case
from _checks import needs_compiler

from bcg_diffusion import accelerate, eager_break, restore, stats
from bcg_diffusion.core.hostile import HostileOpFinder, classify
from bcg_diffusion.models import build_pipeline


class _Block(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.body = body

    def forward(self, x):
        return self.body(self.proj(x))


class _Model(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(lambda x: x), _Block(body)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _scale_by_max(x):
    return x * x.abs().max().item()


BODIES = {
    "host sync": _scale_by_max,
    "data-dependent shape": lambda x: x.flatten()[torch.nonzero(x.flatten() > 0).flatten()].sum() + x,
    "tensor from Python data": lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0]),
}


@pytest.mark.parametrize("kind", list(BODIES))
def test_each_kind_is_found_with_its_module_and_line(kind):
    model = _Model(BODIES[kind])
    with torch.no_grad(), HostileOpFinder() as finder:
        model(torch.randn(2, 4))
    assert [op.kind for op in finder.found] == [kind], finder.found
    (op,) = finder.found
    assert op.module == "blocks.1" and "test_hostile.py:" in op.where, op


def test_boolean_indexing_and_masked_select_are_data_dependent():
    x = torch.randn(8)
    with HostileOpFinder() as finder:
        x[x > 0].sum()
        torch.masked_select(x, x < 0).sum()
    assert {op.kind for op in finder.found} == {"data-dependent shape"} and len(finder.found) == 2


def test_ops_inside_an_eager_break_are_not_found():
    model = _Model(eager_break(_scale_by_max))
    with torch.no_grad(), HostileOpFinder() as finder:
        model(torch.randn(2, 4))
    assert finder.found == []


def test_harmless_code_finds_nothing():
    with torch.no_grad(), HostileOpFinder() as finder:
        _Model(lambda x: torch.nn.functional.gelu(x) * 2)(torch.randn(2, 4))
    assert finder.found == []


def test_copies_between_host_and_gpu_are_classified_by_their_devices():
    copy_ = torch.ops.aten.copy_.default
    cpu = torch.randn(2)
    meta_cuda = torch.empty(2, device="meta")  # stands in for the device side: only its .device is read

    class _Cuda:
        device = torch.device("cuda", 0)

    target = _Cuda()
    assert classify(copy_, (target, cpu), {}, target) == "copy from host memory"
    assert classify(copy_, (meta_cuda, cpu), {}, meta_cuda) is None
    to_copy = torch.ops.aten._to_copy.default
    assert classify(to_copy, (cpu,), {"device": torch.device("cpu")}, cpu) is None


def test_debug_mode_reports_what_a_capture_would_meet():
    import threading

    from bcg_diffusion.core.runner import GraphRunner

    model = _Model(_scale_by_max)
    runner = GraphRunner(model.forward, name="transformer", pool=None, lock=threading.RLock(), debug=True)
    with torch.no_grad():
        for _ in range(3):  # capture, then the first replay (under the finder), then a plain one
            runner(torch.randn(2, 4))
    (record,) = runner.records()
    assert len(record.hostile_ops) == 1, record.hostile_ops
    assert "host sync" in record.hostile_ops[0] and "in blocks.1 at test_hostile.py" in record.hostile_ops[0]


@needs_compiler
@pytest.mark.heavy  # compiles with inductor on CPU
def test_fast_mode_keeps_its_compiled_blocks_under_the_finder():
    # torch.compile refuses to run under a dispatch mode: before the finder stepped aside for compiled
    # regions, debug mode's first replay retired fast mode's compiled blocks for good.
    torch._dynamo.reset()
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    accelerate(pipe, mode="fast", debug=True)
    try:
        for _ in range(2):  # the capture, then the first replay under the finder
            run_case(pipe, "z-image", "no_cfg", height=32, width=32)
        report = stats(pipe)
        assert report["compile_failure"] is None and report["compiles"] > 0, report["compile_failure"]
        assert all(s["hostile_ops"] == [] for s in report["signatures"]), report["signatures"]
    finally:
        restore(pipe)
        torch._dynamo.reset()
