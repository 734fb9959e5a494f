"""Arguments that are objects holding tensors (KV caches, dataclasses, diffusers outputs) join the graph
signature: their tensors become static inputs and their structure keys the graph (bcg_diffusion.core.tree)."""

from __future__ import annotations

import threading

import pytest
import torch
from _cases import flux2_klein_kv_case
from _checks import assert_graphs_ran

from bcg_diffusion import accelerate, restore, stats
from bcg_diffusion.core.runner import GraphRunner
from bcg_diffusion.core.tree import UnsupportedValue, describe, flatten, unflatten


class LayerCache:
    def __init__(self, k=None, v=None):
        self.k, self.v = k, v


class Cache:
    def __init__(self, layers):
        self.layers = [LayerCache(torch.randn(1, 2), torch.randn(1, 2)) for _ in range(layers)]
        self.ref_tokens = 2


def test_an_object_of_tensors_and_plain_values_is_flattened_and_rebuilt():
    cache = Cache(2)
    leaves, spec = flatten({"kv_cache": cache})
    assert len(leaves) == 4 and hash(spec) is not None
    rebuilt = unflatten(spec, leaves)["kv_cache"]
    assert type(rebuilt) is Cache and rebuilt is not cache and rebuilt.ref_tokens == 2
    assert rebuilt.layers[1].v is cache.layers[1].v
    other = Cache(2)
    other.ref_tokens = 3
    assert flatten(other)[1] != flatten(cache)[1], "a plain attribute joins the signature"
    assert flatten(Cache(3))[1] != flatten(cache)[1], "and so does the structure"


def test_an_object_holding_something_unflattenable_names_it():
    cache = Cache(1)
    cache.callback = lambda: None
    with pytest.raises(UnsupportedValue, match=r"builtins\.function .*\(in Cache\.callback\)"):
        flatten(cache)
    with pytest.raises(UnsupportedValue, match="torch._C.Generator"):
        flatten(torch.Generator())


class ReadsCache(torch.nn.Module):
    def forward(self, x, cache):
        return x + sum(layer.k.sum() + layer.v.sum() for layer in cache.layers) * cache.ref_tokens


class FillsCache(torch.nn.Module):
    """Stores a tensor into the cache object it is given, as a KV cache's extract step would."""

    def forward(self, x, cache):
        cache.layers[0].k = x * 2
        return x + 1


def _runner(model):
    return GraphRunner(model.forward, name="model", pool=None, lock=threading.RLock(), debug=True, module=model)


def test_a_runner_replays_a_forward_that_reads_an_object_argument():
    runner, model = _runner(ReadsCache()), ReadsCache()
    x = torch.randn(3)
    with torch.no_grad():
        first, cache = runner(x, Cache(2)), Cache(2)
        assert torch.equal(runner(x, cache), model(x, cache))
    assert runner.counters.captures == 1 and runner.counters.replays == 1 and runner.counters.eager_fallbacks == 0
    del first


def test_a_forward_that_changes_an_object_argument_runs_eagerly_with_the_reason():
    runner = _runner(FillsCache())
    x, cache = torch.randn(3), Cache(1)
    with torch.no_grad(), pytest.warns(UserWarning, match="changes the objects or lists it is given"):
        out = runner(x, cache)
    assert torch.equal(out, x + 1) and torch.equal(cache.layers[0].k, x * 2), "eager's effect on the caller's object"
    assert runner.counters.eager_fallbacks == 1 and runner.records()[0].status == "failed"


def test_flux2_klein_kv_captures_its_kv_cache_steps_and_equals_eager():
    pipe, kwargs = flux2_klein_kv_case()

    def call():
        return pipe(**kwargs, num_inference_steps=3, generator=torch.Generator().manual_seed(0), output_type="pt")

    expected = call().images
    with pytest.warns(UserWarning, match="generic one"):
        accelerate(pipe, debug=True)
    try:
        assert torch.equal(call().images, expected)
        report = assert_graphs_ran(pipe, captures=True)
        assert torch.equal(call().images, expected)
        assert_graphs_ran(pipe, report, captures=False)
        transformer = [s for s in stats(pipe)["signatures"] if s["component"] == "transformer"]
        # the extract step returns a Flux2KVCache; the cached steps take it as an argument
        assert len(transformer) == 2 and any("kv_cache: Flux2KVCache(" in s["signature"] for s in transformer)
    finally:
        restore(pipe)


class Scorer:
    """An argument the signature cannot hold (a class with slots, holding a function)."""

    __slots__ = ("scale", "offset", "fn")

    def __init__(self, scale):
        self.scale = scale
        self.offset = torch.full((3,), scale)
        self.fn = lambda x: x * 2

    def weight(self, x):
        return self.fn(x) + self.offset


class UsesScorer(torch.nn.Module):
    def forward(self, x, scorer):
        assert isinstance(scorer, Scorer)
        return scorer.weight(x.sin()).cos() * scorer.scale + scorer.offset


def test_an_argument_that_cannot_be_flattened_is_used_through_eager_breaks():
    model = UsesScorer()
    runner = _runner(model)
    x = torch.randn(3)
    scales = (1.0, 1.0, 2.0, 1.0)
    with torch.no_grad():
        outs = [runner(x, Scorer(scale)) for scale in scales]
    expected = [model(x, Scorer(scale)) for scale in scales]
    assert all(torch.equal(a, b) for a, b in zip(outs, expected))
    # one signature, which only the object's class keys: the uses of the object are eager breaks, and a new
    # scale (a Python value a break returns) takes another path of the graph, captured once, then switched to
    counters = runner.counters
    assert counters.captures == 1 and counters.eager_fallbacks == 0 and counters.replays == 2
    assert counters.branches == 1 and counters.branch_switches == 1
    [record] = runner.records()
    assert "<Scorer>" in record.signature


def test_an_object_holding_a_function_is_set_aside_whole_and_c_types_are_refused():
    class Holder:
        def __init__(self, scale):
            self.scale, self.fn = scale, (lambda x: x * scale)

    holder = Holder(1.0)
    leaves, spec = flatten({"x": torch.ones(1), "holder": holder}, opaque := [])
    assert opaque == [holder] and len(leaves) == 1 and describe(spec).endswith(".Holder>}")
    # a stand-in for a C type would pass isinstance checks in C code that then reads it as that type's struct
    with pytest.raises(UnsupportedValue, match="torch._C.Generator"):
        flatten(torch.Generator(), [])
