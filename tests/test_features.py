"""The shape of an optional feature: a new one plugs in without touching ``accelerate`` (CPU, debug mode)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
import torch
from _cases import run_case

import bcg_diffusion
from bcg_diffusion import accelerate, restore, stats, warm_up
from bcg_diffusion import features as features_module
from bcg_diffusion.features import Feature
from bcg_diffusion.models import build_pipeline


class CountingFeature(Feature):
    """A dummy feature: counts the transformer's calls around its runner, wraps the VAE's ``decode``
    from outside through the patches it is handed, and adds one warm-up call."""

    name = "counting"
    component = "transformer"
    defaults = {"counted_calls": 0, "counted_warmups": 0}
    instances: list[CountingFeature] = []

    def __init__(self) -> None:
        self.calls = 0
        self.warmups = 0
        self.closed = False
        self.prepared = self.finished = False
        CountingFeature.instances.append(self)

    @classmethod
    def create(cls, setup):
        return cls() if "transformer" in setup.accelerated else None

    def prepare(self, setup, patches):
        self.prepared = bool(setup.modules["transformer"]) and not setup.runners  # before any runner

    def wrap_call(self, target, call):
        if target.component != "transformer":
            return call

        @functools.wraps(call)
        def counted(*args, **kwargs):
            self.calls += 1
            return call(*args, **kwargs)

        return counted

    def finish(self, setup, patches):
        self.finished = "transformer" in setup.runners
        transformer = setup.modules["transformer"]
        patches.replace(transformer, "_counting_marker", True)

    def stats(self):
        return {"counted_calls": self.calls, "counted_warmups": self.warmups}

    def patch_names(self):
        return ["counting marker"]

    def warm_up(self, pipe, call_kwargs):
        self.warmups += 1
        return 0

    def close(self):
        self.closed = True


@pytest.fixture
def counting(monkeypatch):
    CountingFeature.instances.clear()
    monkeypatch.setattr(features_module, "FEATURES", [*features_module.FEATURES, CountingFeature])
    yield CountingFeature


def test_a_new_feature_installs_reports_and_undoes_without_touching_accelerate(counting):
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    expected = run_case(pipe, "z-image", "no_cfg", height=32, width=32)
    assert features_module.defaults()["counted_calls"] == 0  # its keys join stats() through the registry
    accelerate(pipe, debug=True)
    try:
        (feature,) = counting.instances
        assert feature.prepared and feature.finished
        assert stats(pipe)["counted_calls"] == 0 and "counting marker" in stats(pipe)["patches"]
        assert torch.equal(run_case(pipe, "z-image", "no_cfg", height=32, width=32), expected)
        assert stats(pipe)["counted_calls"] == 2  # two steps, one transformer call each
        assert pipe.transformer.__dict__["_counting_marker"] is True
        warm_up(pipe, [(32, 32)], cfg=(False,))
        assert stats(pipe)["counted_warmups"] == 1
    finally:
        restore(pipe)
    assert feature.closed and "_counting_marker" not in pipe.transformer.__dict__


def test_a_shared_module_keeps_its_features_until_its_last_holder_leaves(counting):
    from diffusers import ZImageImg2ImgPipeline

    pipe = build_pipeline("z-image", "tiny")
    relative = ZImageImg2ImgPipeline(**pipe.components)
    accelerate(pipe, debug=True)
    accelerate(relative, debug=True)
    assert len(counting.instances) == 1, "the shared transformer got its feature twice"
    with pytest.warns(bcg_diffusion.BCGWarning, match="still holds"):
        restore(pipe)
    assert not counting.instances[0].closed and "_counting_marker" in pipe.transformer.__dict__
    restore(relative)
    assert counting.instances[0].closed and "_counting_marker" not in pipe.transformer.__dict__


def test_accelerate_names_no_feature():
    """``accelerate`` walks the feature list; no feature or mode is spelled out in the entry point."""
    source = Path(bcg_diffusion.api.__file__).read_text()
    tree = ast.parse(source)
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "accelerate")
    body = ast.get_source_segment(source, function)
    for word in ('"fast"', "batch_cfg", "text_buckets", "compile", "group_norm", "trim", "parallel"):
        assert word not in body.split('"""')[2], f"accelerate() mentions {word}"


class FailingFeature(Feature):
    name = "failing"
    component = "vae"

    @classmethod
    def create(cls, setup):
        return cls()

    def finish(self, setup, patches):
        patches.replace(setup.modules["vae"], "_half_done", True)
        raise RuntimeError("boom")


def test_a_failing_install_leaves_nothing_behind(monkeypatch):
    pipe = build_pipeline("z-image", "tiny")
    monkeypatch.setattr(features_module, "FEATURES", [*features_module.FEATURES, FailingFeature])
    with pytest.raises(RuntimeError, match="boom"):
        accelerate(pipe, debug=True)
    for name in ("transformer", "vae", "text_encoder"):
        leftovers = [k for k in vars(getattr(pipe, name)) if k in ("forward", "decode", "_half_done") or "bcg" in k]
        assert not leftovers, (name, leftovers)
    assert not hasattr(pipe, "_bcg_state")
    monkeypatch.setattr(features_module, "FEATURES", [f for f in features_module.FEATURES if f is not FailingFeature])
    accelerate(pipe, debug=True)  # and it can be accelerated afterwards
    restore(pipe)
