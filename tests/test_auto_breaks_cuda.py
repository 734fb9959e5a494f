"""Automatic eager breaks inside real captures (marker: cuda): a toy model with one operation of each
kind a capture cannot hold is captured without a marked break, replays give eager's bytes, a changed
host value takes (or captures) another path, a GPU tensor from Python data is a graph constant (or,
when its data changes every call, makes its module a break), and ``auto_breaks=False`` falls back as
before."""

from __future__ import annotations

import threading

import pytest
import torch

from bcg_diffusion.core.graphs import GraphPool
from bcg_diffusion.core.runner import GraphRunner

pytestmark = pytest.mark.cuda


class Hostile(torch.nn.Module):
    """A host read deciding the path, boolean indexing, a data-dependent shape read by Python, a copy
    from pageable host memory, and a copy to the host whose values come back as a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.eye(16, device="cuda") + 0.01)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.weight)
        if bool((h.sum() > 0).item()):
            h = h * 2
        picked = h[mask]
        count = int(torch.nonzero(mask).shape[0])
        offsets = torch.arange(x.shape[0], dtype=x.dtype).to(x.device)
        flags = (mask.sum(dim=1) > 3).cpu().tolist()
        bonus = torch.tensor(flags, dtype=x.dtype).to(x.device)
        return h + offsets[:, None] + picked.sum() / count + bonus[:, None]


class BuildsOnTheGpu(torch.nn.Module):
    """``torch.tensor(..., device="cuda")``: its copy runs inside the constructor, out of the
    dispatcher's sight. Its data depends on shapes only: a graph constant."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tensor([float(x.shape[0])] * x.shape[1], device=x.device)


class CountsOnTheGpu(torch.nn.Module):
    """The same with data that changes every call: no constant, so only a module break can hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + torch.tensor([float(self.calls)], device=x.device)


class Outer(torch.nn.Module):
    def __init__(self, embed: torch.nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.embed(torch.cos(x)))


def _runner(module: torch.nn.Module, **options):
    pool = GraphPool(torch.device("cuda"))
    return GraphRunner(module.forward, name="toy", pool=pool, lock=threading.RLock(), module=module, **options)


def _mask(seed: int) -> torch.Tensor:
    mask = torch.zeros(8, 16, dtype=torch.bool, device="cuda")
    mask.view(-1)[torch.randperm(128, generator=torch.Generator().manual_seed(seed))[:40].cuda()] = True
    return mask


@torch.no_grad()
def test_every_hostile_kind_becomes_a_break_and_replays_give_eager_bytes():
    model = Hostile()
    runner = _runner(model)
    mask = _mask(0)
    for _ in range(4):
        x = torch.rand(8, 16, device="cuda") + 0.1  # positive: the host decision stays the same
        assert torch.equal(runner(x, mask), model(x, mask))
    [record] = runner.records()
    assert record.status == "captured" and runner.counters.replays == 3, record
    kinds = {site.split(" (")[1].split(")")[0] for site in record.auto_breaks}
    assert kinds == {"host sync", "data-dependent shape", "copy from host memory"}, record.auto_breaks
    assert record.breaks >= 6 and record.segments >= 2
    assert all(" at test_auto_breaks_cuda.py:" in site for site in record.auto_breaks), record.auto_breaks
    print("\n" + "\n".join(record.auto_breaks))


@torch.no_grad()
def test_a_changed_host_value_takes_another_path():
    model = Hostile()
    runner = _runner(model)
    mask = _mask(0)
    inputs = [torch.rand(8, 16, device="cuda") + 0.1, -torch.rand(8, 16, device="cuda") - 0.1]
    for x in inputs * 3:  # the decision flips every call: two captured paths, then switches between them
        assert torch.equal(runner(x, mask), model(x, mask))
    other = _mask(1)  # another pattern: other host flags and another count
    assert torch.equal(runner(inputs[0], other), model(inputs[0], other))
    assert runner.counters.branches >= 2 and runner.counters.branch_switches >= 3, runner.counters
    assert runner.counters.eager_fallbacks == 0


@pytest.mark.parametrize("where", ["submodule", "root forward"])
@torch.no_grad()
def test_a_gpu_tensor_from_python_data_is_a_graph_constant(where):
    # "root forward": as in Qwen-Image Edit Plus, where no module break could hold it
    model = Outer(BuildsOnTheGpu()) if where == "submodule" else BuildsOnTheGpu()
    runner = _runner(model)
    for _ in range(3):
        x = torch.randn(4, 8, device="cuda")
        assert torch.equal(runner(x), model(x))
    [record] = runner.records()
    assert record.status == "captured" and runner.counters.replays == 2, record
    assert record.breaks == 0 and record.auto_breaks == [], record
    [constant] = record.constants
    assert constant.startswith("torch.tensor (tensor from Python data, held as a graph constant)"), constant
    assert "test_auto_breaks_cuda.py:" in constant
    print("\n" + constant)


@torch.no_grad()
def test_a_gpu_tensor_from_changing_python_data_makes_its_module_a_break():
    model = Outer(CountsOnTheGpu())
    runner = _runner(model)
    counts = []
    for _ in range(3):
        x = torch.randn(4, 8, device="cuda")
        out = runner(x)
        # the module ran as a break in this call: its last count is what the output holds
        assert torch.equal(out, torch.sin(torch.cos(x) + float(model.embed.calls))), model.embed.calls
        counts.append(model.embed.calls)
    [record] = runner.records()
    assert record.status == "captured" and runner.counters.replays == 2, record
    assert any(site.startswith("module embed") for site in record.auto_breaks), record.auto_breaks
    assert counts[2] - counts[1] == counts[1] - counts[0] == 1  # one run of the module per replay


@torch.no_grad()
def test_without_auto_breaks_the_capture_fails_and_runs_eagerly_with_the_reason():
    model = Hostile()
    runner = _runner(model, auto_breaks=False)
    mask = _mask(0)
    x = torch.rand(8, 16, device="cuda")
    with pytest.warns(UserWarning, match="capture failed"):
        assert torch.equal(runner(x, mask), model(x, mask))
    [record] = runner.records()
    assert record.status == "failed" and record.auto_breaks == []
