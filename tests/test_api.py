"""Public API contracts: clear errors for bad input, idempotence, restore."""

from __future__ import annotations

import pytest
import torch
from _checks import assert_graphs_ran
from diffusers import DiffusionPipeline

from bcg_diffusion import AccelerateConfig, BCGWarning, accelerate, restore, stats
from bcg_diffusion.models import build_pipeline


@pytest.fixture(scope="module")
def pipe():
    pipe = build_pipeline("z-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("fn", [accelerate, restore, stats])
def test_none_and_non_pipelines_are_refused(fn):
    with pytest.raises(TypeError, match="got None"):
        fn(None)
    with pytest.raises(TypeError, match="DiffusionPipeline"):
        fn(torch.nn.Linear(2, 2))


def test_bad_options_are_refused_before_anything_is_patched(pipe):
    with pytest.raises(TypeError, match="unknown option"):
        accelerate(pipe, turbo=True)
    with pytest.raises(ValueError, match="warmup_runs"):
        accelerate(pipe, debug=True, warmup_runs=-1)
    with pytest.raises(TypeError, match="AccelerateConfig"):
        accelerate(pipe, config={"debug": True})
    assert "forward" not in pipe.transformer.__dict__


def test_accelerate_twice(pipe):
    assert accelerate(pipe, debug=True) is pipe
    try:
        wrapper = pipe.transformer.__dict__["forward"]
        assert accelerate(pipe, config=AccelerateConfig(debug=True)) is pipe  # same options: no-op
        assert pipe.transformer.__dict__["forward"] is wrapper
        with pytest.raises(ValueError, match="restore"):
            accelerate(pipe, debug=True, components=("vae",))
    finally:
        restore(pipe)


def test_restore_and_stats_on_a_plain_pipeline():
    pipe = build_pipeline("z-image", "tiny", device="cpu")  # never accelerated (the module's pipe is restored)
    with pytest.warns(BCGWarning, match="not accelerated"):
        assert restore(pipe) is pipe
    with pytest.raises(ValueError, match="not accelerated"):
        stats(pipe)


def test_changed_options_name_only_what_changed(pipe):
    accelerate(pipe, debug=True)
    try:
        with pytest.raises(ValueError, match="restore") as info:
            accelerate(pipe, debug=True, mode="fast")
    finally:
        restore(pipe)
    message = str(info.value)
    assert "(mode: 'exact' → 'fast')" in message, message
    assert "AccelerateConfig(" not in message and len(message) < 200, message


def test_a_relative_with_other_options_is_told_what_differs(pipe):
    from diffusers import ZImageImg2ImgPipeline

    relative = ZImageImg2ImgPipeline(**pipe.components)
    accelerate(pipe, debug=True)
    try:
        with pytest.raises(ValueError, match="same options") as info:
            accelerate(relative, debug=True, max_signatures=4, warmup=[(64, 64)])
    finally:
        restore(pipe)
    message = str(info.value)
    assert "(max_signatures: None → 4)" in message, message  # the warm-up is no option of the graphs
    assert "AccelerateConfig(" not in message and "warmup" not in message, message


def test_stats_after_restore_says_so_with_zero_counters(pipe):
    from bcg_diffusion import invalidate

    accelerate(pipe, debug=True)
    pipe(prompt="a fox", height=32, width=32, num_inference_steps=1, output_type="pt")
    assert stats(pipe)["captures"] > 0
    restore(pipe)
    report = stats(pipe)
    assert report["active"] is False and "restored" in report["reason"], report["reason"]
    assert report["captures"] == report["replays"] == report["graph_memory_bytes"] == 0
    assert report["signatures"] == [] and report["components"] == {} and report["shared_with"] == []
    assert (report["mode"], report["debug"], report["adapter"]) == ("exact", True, "z-image")
    with pytest.raises(ValueError, match="not accelerated.*restored"):
        invalidate(pipe)  # stats alone reports a restored pipeline; acting on its graphs needs accelerate
    with pytest.warns(BCGWarning, match="not accelerated"):
        restore(pipe)
    accelerate(pipe, debug=True)
    try:
        assert stats(pipe)["active"] is True and stats(pipe)["reason"] is None
    finally:
        restore(pipe)


def test_quantize_on_a_cpu_pipeline_says_it_was_not_applied(pipe):
    with pytest.warns(BCGWarning, match="leaving .* eager") as warned:
        accelerate(pipe, quantize="fp8")
    try:
        message = " ".join(str(w.message) for w in warned)
        assert 'quantize="fp8" was not applied either' in message, message
        assert "compute capability 8.9" in message, message
    finally:
        restore(pipe)


def test_components_option_limits_what_is_patched(pipe):
    accelerate(pipe, debug=True, components=("vae",))
    try:
        assert "forward" not in pipe.transformer.__dict__ and "decode" in pipe.vae.__dict__
        assert set(stats(pipe)["components"]) == {"vae"}
    finally:
        restore(pipe)


def test_default_components_are_the_adapters(pipe):
    accelerate(pipe, debug=True)
    try:
        assert set(stats(pipe)["components"]) == {"transformer", "vae", "text_encoder"}
        assert accelerate(pipe, debug=True, components=("transformer", "vae", "text_encoder")) is pipe  # the same
    finally:
        restore(pipe)
    qwen = build_pipeline("qwen-image", "tiny", device="cpu")
    accelerate(qwen, debug=True)
    try:
        assert set(stats(qwen)["components"]) == {"transformer", "vae"}
    finally:
        restore(qwen)


def test_a_text_encoder_on_another_device_stays_eager(pipe, monkeypatch, caplog):
    from bcg_diffusion import api

    monkeypatch.setattr(api, "_execution_device", lambda pipe: torch.device("meta"))
    adapter = api.adapter_for(pipe)
    with caplog.at_level("INFO", logger="bcg_diffusion.api"):
        config = api._with_components(pipe, AccelerateConfig(debug=True), adapter)
    assert config.components == ("transformer", "vae")  # defaulted: dropped with a log line, no warning
    assert "text_encoder stays eager" in caplog.text
    with pytest.warns(BCGWarning, match="text_encoder stays eager: it is on"):
        config = api._with_components(pipe, AccelerateConfig(debug=True, components=("text_encoder", "vae")), adapter)
    assert config.components == ("vae",)


def test_wrapper_keeps_the_signature_of_the_original(pipe):
    import inspect

    original = inspect.signature(pipe.transformer.forward)
    accelerate(pipe, debug=True)
    try:
        assert inspect.signature(pipe.transformer.forward) == original
    finally:
        restore(pipe)


class _NoTransformer(DiffusionPipeline):
    def __init__(self, unet):
        super().__init__()
        self.register_modules(unet=unet)


class _CustomTransformerPipeline(DiffusionPipeline):
    def __init__(self, transformer):
        super().__init__()
        self.register_modules(transformer=transformer)

    def __call__(self, x):
        return self.transformer(x)


def test_unknown_pipelines():
    with pytest.raises(TypeError, match="no `transformer`"):
        accelerate(_NoTransformer(unet=torch.nn.Linear(2, 2)), debug=True)
    custom = _CustomTransformerPipeline(transformer=torch.nn.Linear(4, 4))
    with pytest.warns(BCGWarning, match="generic"):
        accelerate(custom, debug=True)
    try:
        x = torch.randn(2, 4)
        with torch.no_grad():
            expected = custom.transformer.__dict__["forward"].__wrapped__(x)
            assert torch.equal(custom(x), expected)
            assert torch.equal(custom(x), expected)
        assert stats(custom)["replays"] == 1 and stats(custom)["adapter"] == "generic"
        assert_graphs_ran(custom, captures=True)
    finally:
        restore(custom)


def test_eager_block_bypasses_graphs_and_keeps_them(pipe):
    from bcg_diffusion import eager

    with pytest.raises(ValueError, match="not accelerated"), eager(pipe):
        pass
    accelerate(pipe, debug=True)
    try:
        x = [torch.randn(4, 1, 4, 4)]
        t = torch.tensor([0.5])
        caps = [torch.randn(7, pipe.transformer.config.cap_feat_dim)]
        with torch.no_grad():
            pipe.transformer(x, t, caps, return_dict=False)
            before = stats(pipe)
            with eager(pipe):
                pipe.transformer(x, t, caps, return_dict=False)
            assert stats(pipe)["replays"] == before["replays"] and stats(pipe)["captures"] == before["captures"]
            pipe.transformer(x, t, caps, return_dict=False)
        assert stats(pipe)["replays"] == before["replays"] + 1
    finally:
        restore(pipe)


def test_concurrent_calls_equal_serial_calls(pipe):
    import threading

    seeds = [0, 1, 2, 3]

    def call(seed):
        return pipe(
            prompt="a red fox in the snow",
            height=32,
            width=32,
            num_inference_steps=3,
            guidance_scale=0.0,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="pt",
        ).images

    accelerate(pipe, debug=True)
    try:
        assert type(pipe).__name__ == "ZImagePipeline"  # the serialising subclass keeps the name
        serial = {seed: call(seed) for seed in seeds}
        results, errors = {}, []

        def worker(seed):
            try:
                results[seed] = call(seed)
            except Exception as exc:  # reported below, not swallowed
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(seed,)) for seed in seeds]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        assert all(torch.equal(results[seed], serial[seed]) for seed in seeds)
    finally:
        restore(pipe)
    from diffusers import ZImagePipeline

    assert type(pipe) is ZImagePipeline
