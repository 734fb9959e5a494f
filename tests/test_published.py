"""The pipelines people serve besides Qwen-Image and Z-Image (FLUX.1, FLUX.2 klein, Wan, Qwen-Image-Edit), on a CPU:
what every model made of diffusers' shared building blocks gets without a model patch.

* FP8 attention through diffusers' dispatcher (``patches.dispatched_attention``): which processors it takes,
  how a call is routed, and on each tiny pipeline in fast mode: the kernel reached (a stand-in for the GPU
  kernel, which does not run here) and the graphs' bytes equal to the compiled blocks without graphs;
* ``quantize="fp8"``'s default filter on each family's blocks at their published sizes (meta device);
* Wan 2.2: fast mode compiles both experts, and one built with ``transformer=None`` is accelerated;
* fast mode batches Qwen-Image-Edit's CFG calls;
* a ControlNet (FLUX.1's, Qwen-Image's) captured when named in ``components``;
* diffusers' step caches inside each family's graphs;
* ``python -m bench --pipeline flux | flux2-klein | wan | qwen-image-edit | hunyuan-image`` (its defaults, a tiny
  run).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _checks import assert_graphs_ran
from diffusers.models.attention_dispatch import attention_backend
from diffusers.models.attention_dispatch import dispatch_attention_fn as diffusers_dispatch

from bcg_diffusion import BCGWarning, accelerate, eager, restore, stats
from bcg_diffusion.core import tree
from bcg_diffusion.features import compiled_controlnet, fp8_attention
from bcg_diffusion.features.compiled_controlnet import COMPILED_CONTROLNET
from bcg_diffusion.features.controlnet_scale import CONTROLNET_SCALE
from bcg_diffusion.features.quantization import default_filter
from bcg_diffusion.kernels import attention as triton_kernels
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.patches import dispatched_attention
from bench import cli
from bench import modes as bench_modes
from bench.coverage import _call
from bench.coverage_models import FULL, TINY, live_controlnet

PIPELINES = ("FLUX.1", "FLUX.2 klein", "Wan 2.1 T2V", "Qwen-Image Edit Plus")


def _fake_fp8_attention(query, key, value, scale=None):
    """What the test puts in the GPU kernel's place: attention on the query and key rounded through float8
    e4m3, so its result differs from bf16 attention's (the kernel was reached) and is deterministic."""
    query, key = (x.to(torch.float8_e4m3fn).to(x.dtype) for x in (query, key))
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale=scale
    )
    return out.transpose(1, 2)


@pytest.fixture
def fp8_kernel_on_cpu(monkeypatch):
    """FP8 attention made available on the CPU: our Triton kernel's name (cuDNN's said unavailable), with
    :func:`_fake_fp8_attention` in its place."""
    monkeypatch.setattr(fp8_attention, "unavailable", lambda device: None)
    monkeypatch.setattr(fp8_attention.cudnn_fp8_attention, "unavailable", lambda device: "not on a CPU")
    monkeypatch.setattr(triton_kernels, "unsupported", lambda q, k, v: None)
    monkeypatch.setattr(triton_kernels, "fp8_attention", _fake_fp8_attention)


@functools.cache
def _meta(name):
    return FULL[name].build(torch.device("meta"))


def test_processors_of_every_family_dispatch_and_fast_modes_own_are_left_to_it():
    for name in PIPELINES:
        pipe, _ = TINY[name]()
        modules = fp8_attention.attention_modules(pipe.transformer)
        assert modules, name
        processors = {type(m.processor).__name__ for m in modules}
        if name.startswith("Qwen"):  # fast mode's own processor (attend), not the generic dispatch
            assert processors == {"QwenDoubleStreamAttnProcessor2_0"}
            assert not any(fp8_attention._dispatching(m) for m in modules)
        else:
            assert all(dispatched_attention.dispatches_attention(m.processor) for m in modules), processors
    assert not dispatched_attention.dispatches_attention(object())


def test_dispatch_sends_plain_calls_to_the_kernel_and_the_rest_to_diffusers(fp8_kernel_on_cpu):
    dispatch = dispatched_attention.kernel_dispatch("fp8")
    assert dispatch is dispatched_attention.kernel_dispatch("fp8")  # one function per kernel
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 64) for _ in range(3))
    assert torch.equal(dispatch(q, k, v), _fake_fp8_attention(q, k, v))
    assert torch.equal(dispatch(q, k, v, scale=0.5), _fake_fp8_attention(q, k, v, scale=0.5))
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool)
    for kwargs in ({"attn_mask": mask}, {"is_causal": True}, {"backend": "native"}, {"scale": 0.5, "dropout_p": 0.0}):
        expected = diffusers_dispatch(q, k, v, **kwargs)
        if "scale" in kwargs:  # plain: the kernel
            expected = _fake_fp8_attention(q, k, v, scale=0.5)
        assert torch.equal(dispatch(q, k, v, **kwargs), expected), kwargs
    assert torch.equal(dispatch(q, k, v, mask), diffusers_dispatch(q, k, v, mask))  # positional mask
    with pytest.raises(ValueError, match="expected one of"):
        dispatched_attention.kernel_dispatch("flash")


@pytest.mark.heavy  # compiles the tiny blocks with inductor on the CPU
@pytest.mark.parametrize("name", PIPELINES)
def test_fp8_attention_reaches_every_family_and_graphs_equal_its_compiled_blocks(name, fp8_kernel_on_cpu):
    pipe, inputs = TINY[name]()
    with torch.no_grad():
        bf16 = _call(pipe, inputs)
    processors = {m: m.processor for m in fp8_attention.attention_modules(pipe.transformer)}
    accelerate(pipe, mode="fast", attention="fp8", debug=True)
    try:
        report = stats(pipe)
        assert report["attention"] == "fp8" and report["fp8_attention_modules"] == len(processors), report
        assert report["fp8_attention_kernels"] == {"triton": len(processors)}
        if not name.startswith("Qwen"):  # each processor's copy names its kernel
            kernels = {getattr(m.processor, dispatched_attention.KERNEL_OF_CLASS) for m in processors}
            assert kernels == {"fp8"}, kernels
        fast = _call(pipe, inputs)
        with eager(pipe):  # the compiled blocks without graphs: what fast mode must equal
            reference = _call(pipe, inputs)
        assert torch.equal(fast, reference)
        assert not torch.equal(fast, bf16)  # the FP8 stand-in ran
        after = stats(pipe)
        assert after["compile_failure"] is None and after["compiles"] > 0 and after["eager_fallbacks"] == 0, after
    finally:
        restore(pipe)
    assert all(module.processor is processor for module, processor in processors.items())


@pytest.mark.parametrize("name", ["FLUX.1", "FLUX.2", "Wan 2.1 T2V", "Qwen-Image Edit Plus"])
def test_fp8_default_filter_takes_each_familys_token_products_and_leaves_modulation(name):
    transformer = _meta(name).transformer
    chosen = default_filter(transformer)
    fp8, bf16 = collections.Counter(), collections.Counter()
    for fqn, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear):
            short = ".".join(part for part in fqn.split(".")[1:] if not part.isdigit())  # block's own name
            (fp8 if chosen(module, fqn) else bf16)[short] += 1
    # the query, key and value products of every block are FP8 (FLUX.2's single blocks: one fused product)
    assert any(key.endswith(("to_q", "to_qkv_mlp_proj")) for key in fp8), fp8
    # modulation (one row per sample) stays bf16: diffusers' AdaLayerNorm linears, Qwen's img_mod / txt_mod
    assert not any("norm" in key or key.endswith(("img_mod", "txt_mod")) for key in fp8), fp8
    # attention output projections stay bf16, as documented
    assert not any(key.endswith("to_out.0") for key in fp8), fp8
    if name == "FLUX.1":
        assert bf16["norm1.linear"] == 19 and bf16["norm1_context.linear"] == 19 and bf16["norm.linear"] == 38


def test_wan22_with_only_its_second_expert_is_accelerated(recwarn):
    pipe, inputs = _wan22_second_expert_only()
    with torch.no_grad():
        expected = _call(pipe, inputs)
    accelerate(pipe, debug=True)
    try:
        assert torch.equal(_call(pipe, inputs), expected)
        report = stats(pipe)
        assert report["active"] and sorted(report["components"]) == ["transformer_2", "vae"], report["components"]
        assert report["components"]["transformer_2"]["replays"] > 0
    finally:
        restore(pipe)
    assert not any("has no `transformer`" in str(w.message) for w in recwarn if w.category is BCGWarning)


@pytest.mark.heavy  # compiles the tiny blocks with inductor on the CPU
def test_fast_mode_batches_the_cfg_calls_of_qwen_image_edit():
    # Edit Plus (2511): with zero_cond_t its forward modulates per sample from img_shapes, which the batch doubles.
    pipe, inputs = TINY["Qwen-Image Edit Plus"]()
    accelerate(pipe, mode="fast", debug=True, batch_cfg=False)
    try:
        unbatched = _call(pipe, inputs)
    finally:
        restore(pipe)
    accelerate(pipe, mode="fast", debug=True)
    try:
        batched = [_call(pipe, inputs) for _ in range(2)]
        with eager(pipe):  # batched too: the compiled blocks without graphs
            reference = _call(pipe, inputs)
        report = stats(pipe)
        assert report["cfg_batched"] >= 4 and report["cfg_batch_dropped"] == 0, report  # both steps, both calls
        assert all(torch.equal(images, reference) for images in batched)
        # another GEMM shape rounds differently, nothing more; zero_cond_t's per-sample modulation holds
        torch.testing.assert_close(batched[0], unbatched, rtol=0, atol=1e-5)
    finally:
        restore(pipe)


# Two blocks (of each kind): with one, diffusers' MagCache puts its head and tail hooks on the same block and
# steps differently, which bcg-diffusion's mirror of it refuses with an error (no real model has one block).
TWO_BLOCKS = {
    "FLUX.1": {"num_layers": 2, "num_single_layers": 2},
    "FLUX.2 klein": {"num_layers": 2, "num_single_layers": 2},
    "Wan 2.1 T2V": {"num_layers": 2},
    "Wan 2.2 T2V": {"num_layers": 2},
    "Qwen-Image Edit Plus": {"num_layers": 2},
    "HunyuanImage": {"num_layers": 2, "num_single_layers": 2},
}


@pytest.mark.parametrize("cache", ["magcache", "first-block", "taylorseer"])
@pytest.mark.parametrize("name", [*PIPELINES, "HunyuanImage"])
def test_step_caches_run_inside_the_graphs_of_every_family(name, cache):
    from bcg_diffusion.features.step_caching import enable_cache
    from bench.caching import cache_config

    if (name, cache) == ("FLUX.2 klein", "first-block"):
        pytest.skip("diffusers 0.42's FirstBlockCache fails on FLUX.2's blocks eagerly (a list where it subtracts)")
    pipe, inputs = TINY[name]()
    torch.manual_seed(0)
    pipe.transformer = type(pipe.transformer).from_config({**pipe.transformer.config, **TWO_BLOCKS[name]})
    enable_cache(pipe, cache_config(cache, 6))
    with torch.no_grad():
        expected = _call(pipe, inputs, steps=6)
    accelerate(pipe, debug=True)
    try:
        assert all(torch.equal(_call(pipe, inputs, steps=6), expected) for _ in range(2))
        assert stats(pipe)["eager_fallbacks"] == 0
    finally:
        restore(pipe)


@pytest.mark.parametrize("name", [*PIPELINES, "Wan 2.2 T2V"])  # HunyuanImage: tests/test_hunyuanimage.py
def test_cache_dit_runs_inside_the_graphs_of_every_family(name):
    """Cache-DiT's DBCache on a static computation mask (compute, reuse, ...), enabled before ``accelerate``: each
    family's blocks run on the graphs (both of Wan 2.2's experts) with Cache-DiT's host logic in eager breaks, and
    every call gives the bytes of eager with the same cache, reusing it on the same steps."""
    cache_dit = pytest.importorskip("cache_dit")
    from _caches import cachedit_options

    def cached_pipe():  # the same weights and inputs each time
        torch.manual_seed(0)
        pipe, inputs = TINY[name]()
        for expert in ("transformer", "transformer_2"):
            if (model := getattr(pipe, expert, None)) is not None:
                setattr(pipe, expert, type(model).from_config({**model.config, **TWO_BLOCKS[name]}))
        cache_dit.enable_cache(pipe, **cachedit_options("static", steps=8))
        return pipe, inputs

    reference, inputs = cached_pipe()
    with torch.no_grad():
        expected = _call(reference, inputs, steps=8)
    reused = _cachedit_reused(reference)
    assert reused > 0, reused
    pipe, _ = cached_pipe()
    accelerate(pipe, debug=True)
    try:
        for _ in range(2):
            assert torch.equal(_call(pipe, inputs, steps=8), expected)
            assert _cachedit_reused(pipe) == reused
        report = stats(pipe)
        assert report["eager_fallbacks"] == 0 and report["components"]["transformer"]["replays"] > 0, report
        if name.startswith("Wan 2.2"):
            assert report["components"]["transformer_2"]["replays"] > 0, report
    finally:
        restore(pipe)


def _cachedit_reused(pipe: Any) -> int:
    """How many transformer calls Cache-DiT served from its cache in the pipeline's last call."""
    contexts = pipe.transformer._context_manager._cached_context_manager.values()
    return sum(len(context.cached_steps) + len(context.cfg_cached_steps) for context in contexts)


def _wan22_second_expert_only():
    """Wan 2.2 as diffusers' own test builds it without its first expert: boundary_ratio 1.0, so every step
    runs transformer_2."""
    from diffusers import UniPCMultistepScheduler

    base, inputs = TINY["Wan 2.2 T2V"]()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return type(base)(**{**base.components, "transformer": None, "scheduler": scheduler}, boundary_ratio=1.0), inputs


@pytest.mark.heavy  # compiles the tiny blocks with inductor on the CPU
@pytest.mark.parametrize("first_expert", [True, False], ids=["both experts", "transformer_2 only"])
def test_fast_mode_compiles_every_expert_of_wan22(first_expert, recwarn):
    pipe, inputs = TINY["Wan 2.2 T2V"]() if first_expert else _wan22_second_expert_only()
    with torch.no_grad():
        plain = _call(pipe, inputs)
    accelerate(pipe, mode="fast", debug=True)
    try:
        fast = _call(pipe, inputs)
        with eager(pipe):
            reference = _call(pipe, inputs)
        assert torch.equal(fast, reference) and not torch.equal(fast, plain)  # compiled blocks in both experts
        report = stats(pipe)
        second = report["experts"]["transformer_2"]
        assert second["compiled_blocks"] == len(pipe.transformer_2.blocks) and second["compile_failure"] is None
        assert report["compiled_blocks"] == (len(pipe.transformer.blocks) if first_expert else 0), report
    finally:
        restore(pipe)
    assert not any("mode='fast' falls back" in str(w.message) for w in recwarn), [str(w.message) for w in recwarn]
    assert all(type(block.forward).__name__ == "method" for block in pipe.transformer_2.blocks)  # given back


def test_a_pipeline_without_any_transformer_is_refused():
    from bcg_diffusion.pipelines import adapter_for

    class NoDenoiser:
        transformer = transformer_2 = None

    with pytest.raises(TypeError, match="no `transformer`"):
        adapter_for(NoDenoiser())


def test_bench_knows_the_published_pipelines_at_the_sizes_people_render():
    from bench import runs
    from bench.published import PUBLISHED

    assert tuple(PUBLISHED) == runs.PUBLISHED_PIPELINES  # what --help offers without importing torch
    flux = cli.parse_args(["--pipeline", "flux", "--weights", "tiny"]).cases
    assert [(c.width, c.height, c.steps, c.guidance, c.uses_cfg, c.frames) for c in flux] == [
        (1024, 1024, 28, 3.5, False, None)
    ]
    [wan] = cli.parse_args(["--pipeline", "wan", "--weights", "tiny"]).cases
    assert (wan.width, wan.height, wan.frames, wan.steps, wan.uses_cfg) == (832, 480, 81, 3, True)
    assert "832x480x81, 3 steps, cfg 5" in wan.label
    [klein] = cli.parse_args(["--pipeline", "flux2-klein", "--weights", "tiny", "--steps", "2"]).cases
    assert (klein.steps, klein.uses_cfg) == (2, False)
    [edit] = cli.parse_args(["--pipeline", "qwen-image-edit", "--weights", "tiny"]).cases
    assert edit.uses_cfg and edit.kwargs()["true_cfg_scale"] == 4.0 and "image" in edit.kwargs()
    [hunyuan] = cli.parse_args(["--pipeline", "hunyuan-image", "--weights", "tiny"]).cases
    assert (hunyuan.width, hunyuan.height, hunyuan.steps, hunyuan.uses_cfg) == (2048, 2048, 8, True)
    assert "guidance_scale" not in hunyuan.kwargs() and "cfg 3.5" in hunyuan.label  # its guider's
    [zimage] = cli.parse_args(["--pipeline", "z-image", "--weights", "tiny"]).cases
    assert (zimage.width, zimage.steps, zimage.guidance) == (512, 8, 0.0)  # unchanged defaults
    args = cli.parse_args(["--pipeline", "flux", "--pipeline", "wan"])
    assert args.modes[:3] == ["eager", "bcg", "fast"] or args.device.type == "cpu"


@pytest.mark.parametrize("argv", [["--pipeline", "z-image", "--frames", "9"], ["--pipeline", "flux", "--frames", "9"]])
def test_bench_refuses_frames_for_an_image_pipeline(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args([*argv, "--weights", "tiny"])
    assert exc.value.code == 2
    assert "--frames is for" in capsys.readouterr().err


def test_bench_refuses_a_guidance_the_pipelines_guider_holds(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--pipeline", "hunyuan-image", "--weights", "tiny", "--guidance", "5"])
    assert exc.value.code == 2
    assert "hunyuan-image's guider holds its guidance (3.5)" in capsys.readouterr().err


def test_bench_times_each_mode_apart_where_the_modes_do_not_fit_together(tmp_path, capsys):
    from bench import timing

    assert timing.groups(["eager", "bcg", "compile-max"], apart=False) == [["eager", "bcg"], ["eager", "compile-max"]]
    assert timing.groups(["eager", "bcg", "fast"], apart=True) == [["eager", "bcg"], ["eager", "fast"]]
    assert timing.groups(["eager"], apart=True) == [["eager"]]
    code = cli.main(  # hunyuan-image asks for it (its 2048² modes do not fit an 80 GB GPU together)
        ["--pipeline", "hunyuan-image", "--weights", "tiny", "--resolutions", "64x64", "--steps", "2", "--runs", "1"]
        + ["--warmup", "0", "--modes", "eager,bcg", "--no-progress", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Each mode ran in a group of its own beside a fresh eager" in out and "| bcg |" in out
    assert "yes (md5)" in out and "cfg 3.5" in out


def test_bench_times_a_published_pipeline_on_the_cpu(tmp_path, capsys):
    code = cli.main(
        ["--pipeline", "flux2-klein", "--weights", "tiny", "--resolutions", "64x64", "--runs", "1", "--warmup", "0"]
        + ["--no-progress", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "flux2-klein 64x64, 4 steps, no cfg" in out and "Denoising per step" in out
    assert "ran after the other modes" not in out and "group of its own" not in out  # one group, in turns
    assert "| bcg |" in out and "yes (md5)" in out


def test_bench_times_a_controlnet_as_graphs_and_eager(tmp_path, capsys):
    """``flux-controlnet``'s ControlNet runs as graphs, as accelerate does by default; the ``-no-controlnet``
    modes leave it eager, so that each pair differs only in the ControlNet's graphs. Every copy has a ControlNet
    of its own: one shared by two modes accelerated with other options was refused."""
    import json

    code = cli.main(
        ["--pipeline", "flux-controlnet", "--weights", "tiny", "--resolutions", "64x64", "--steps", "2"]
        + ["--runs", "1", "--warmup", "0", "--modes", "eager,bcg,bcg-no-controlnet,fast,fast-no-controlnet"]
        + ["--no-progress", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    [case] = json.loads((tmp_path / "results.json").read_text())["cases"]
    rows = case["modes"]
    assert all(rows[mode]["identical"] for mode in ("bcg", "bcg-no-controlnet")), rows
    assert all(rows[mode]["identical_to_reference"] for mode in ("fast", "fast-no-controlnet")), rows
    captures = {
        mode: rows[mode]["graphs"]["captures"] for mode in ("bcg", "bcg-no-controlnet", "fast", "fast-no-controlnet")
    }
    assert captures == {"bcg": 3, "bcg-no-controlnet": 2, "fast": 3, "fast-no-controlnet": 2}  # + the ControlNet
    for mode in ("bcg-no-controlnet", "fast-uncompiled-controlnet"):
        with pytest.raises(ValueError, match="has no ControlNet"):
            bench_modes.prepare(mode, TINY["FLUX.1"]()[0], torch.device("cpu"))
    assert bench_modes.parse("fast-uncompiled-controlnet") == bench_modes.ModeOptions(
        "fast", uncompiled_controlnet=True
    )


def test_bench_encodes_prompts_with_the_published_pipelines_text_encoders(tmp_path, capsys):
    import json

    code = cli.main(
        ["--pipeline", "flux", "--weights", "tiny", "--text-encoders", "--resolutions", "64x64", "--steps", "2"]
        + ["--runs", "1", "--warmup", "0", "--modes", "eager,bcg,bcg-te", "--no-progress", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "flux 64x64, 2 steps, no cfg, text encoders" in out
    [case] = json.loads((tmp_path / "results.json").read_text())["cases"]
    modes = case["modes"]
    assert all(modes[name]["identical"] for name in ("bcg", "bcg-te")), modes
    # CLIP and T5 stay eager by default (transformer, VAE); -te names them (text_encoder, text_encoder_2 too)
    assert (modes["bcg"]["graphs"]["captures"], modes["bcg-te"]["graphs"]["captures"]) == (2, 4), modes


@pytest.mark.parametrize("pipeline", ["qwen-image-edit", "z-image"])
def test_bench_refuses_text_encoders_it_cannot_build(pipeline, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--pipeline", pipeline, "--weights", "tiny", "--text-encoders"])
    assert exc.value.code == 2
    assert "--text-encoders is for" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:.*has no adapter")
def test_a_text_encoder_outside_the_default_classes_is_captured_only_when_named(caplog):
    """The generic adapter captures by default only the encoder classes measured faster (Qwen3); FLUX.1's CLIP and
    T5 stay eager, with a log line saying how to opt in, and named in ``components`` they are captured."""
    pipe, inputs = _with_text_encoder("FLUX.1")
    with torch.no_grad():
        expected = _call(pipe, inputs)
    for components in (None, ("transformer", "vae", "text_encoder", "text_encoder_2")):
        with caplog.at_level("INFO", logger="bcg_diffusion"):
            accelerate(pipe, components=components, debug=True)
        try:
            assert torch.equal(_call(pipe, inputs), expected)
            captured = set(stats(pipe)["components"])
        finally:
            restore(pipe)
        if components is None:
            assert captured == {"transformer", "vae"}, captured
            assert "text_encoder_2 stays eager: T5EncoderModel is not captured by default" in caplog.text
        else:
            assert captured == {"transformer", "vae", "text_encoder", "text_encoder_2"}, captured


@pytest.mark.parametrize("cache", ["magcache", "first-block"])
def test_step_caches_on_both_experts_of_wan22_run_inside_their_graphs(cache):
    from bcg_diffusion.features.step_caching import enable_cache
    from bench.caching import cache_config

    pipe, inputs = TINY["Wan 2.2 T2V"]()
    torch.manual_seed(0)
    for name in ("transformer", "transformer_2"):
        setattr(pipe, name, type(pipe.transformer).from_config({**pipe.transformer.config, "num_layers": 2}))
        enable_cache(getattr(pipe, name), cache_config(cache, 6))
    with torch.no_grad():
        expected = _call(pipe, inputs, steps=6)
    accelerate(pipe, debug=True)
    try:
        assert all(torch.equal(_call(pipe, inputs, steps=6), expected) for _ in range(2))
        report = stats(pipe)
        assert report["eager_fallbacks"] == 0, report
        # each expert's cache decisions are part of its own graphs' keys
        assert report["cache_states"] > 0 and report["experts"]["transformer_2"]["cache_states"] > 0, report
    finally:
        restore(pipe)


_BENCH_NAMES = {"FLUX.1": "flux", "FLUX.2 klein": "flux2-klein", "Wan 2.1 T2V": "wan"}


def _with_text_encoder(name: str) -> tuple[Any, dict[str, Any]]:
    """The tiny pipeline ``name`` with tiny text encoders of its family and the offline tokenizer, as
    ``python -m bench --text-encoders`` builds them (:mod:`bench.published_text`): FLUX.2 klein's Qwen3 (two
    layers read, as klein reads three of Qwen3-4B's), Wan's UMT5 encoder (with a negative prompt), FLUX.1's
    CLIP and T5 (its ``text_encoder_2``)."""
    from bench.published_text import encoder_call_inputs, with_text_encoders

    pipe, inputs = TINY[name]()
    bench_name = _BENCH_NAMES[name]
    pipe = with_text_encoders(pipe, bench_name, "tiny", torch.device("cpu"))
    calls = {"prompt": "a red fox in the snow", **encoder_call_inputs(bench_name, "tiny")}
    if name.startswith("Wan"):
        calls["negative_prompt"] = "blurry"
    kept = {key: value for key, value in inputs.items() if "prompt" not in key}
    return pipe, {**kept, **calls}


@pytest.mark.filterwarnings("ignore:.*has no adapter")
@pytest.mark.parametrize("name", ["FLUX.2 klein", "Wan 2.1 T2V", "FLUX.1"])
def test_text_encoders_of_the_published_families_are_captured_and_exact(name):
    pipe, inputs = _with_text_encoder(name)
    with torch.no_grad():
        expected = _call(pipe, inputs)
    encoders = ("text_encoder", "text_encoder_2") if name == "FLUX.1" else ("text_encoder",)
    # klein's Qwen3 by default; T5, UMT5 and CLIP named (they stay eager by default: run 185 measured no gain)
    components = None if name == "FLUX.2 klein" else ("transformer", "vae", *encoders)
    accelerate(pipe, components=components, debug=True)
    try:
        assert all(torch.equal(_call(pipe, inputs), expected) for _ in range(2))
        report = stats(pipe)
        assert report["eager_fallbacks"] == 0, report
        for encoder in encoders:
            counters = report["components"][encoder]
            assert counters["captures"] >= 1 and counters["replays"] >= 1, report
    finally:
        restore(pipe)


_CONTROL = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))  # a ControlNet's conditioning image


def _with_controlnet(pipeline_class: type, base: Any, controlnet: torch.nn.Module) -> Any:
    """A ``pipeline_class`` (a ControlNet pipeline) of ``base``'s components that it takes, and ``controlnet``."""
    parameters = inspect.signature(pipeline_class.__init__).parameters
    components = {name: module for name, module in base.components.items() if name in parameters}
    return pipeline_class(**components, controlnet=controlnet)


def _qwen_image_controlnet() -> tuple[Any, dict[str, Any]]:
    """Tiny Qwen-Image with a ControlNet (``QwenImageControlNetPipeline``, its tiny text encoder) and its call's
    inputs."""
    from diffusers import QwenImageControlNetModel, QwenImageControlNetPipeline

    base = build_pipeline("qwen-image", "tiny")
    config = base.transformer.config
    controlnet = live_controlnet(QwenImageControlNetModel(
        patch_size=config.patch_size, in_channels=config.in_channels, out_channels=config.out_channels,
        num_layers=1, attention_head_dim=config.attention_head_dim, num_attention_heads=config.num_attention_heads,
        joint_attention_dim=config.joint_attention_dim, axes_dims_rope=config.axes_dims_rope,
        extra_condition_channels=0,
    ))  # fmt: skip
    pipe = _with_controlnet(QwenImageControlNetPipeline, base, controlnet)
    return pipe, {"prompt": "a cat", "negative_prompt": "blurry", "true_cfg_scale": 4.0, "control_image": _CONTROL}


def _flux_multi_controlnet() -> tuple[Any, dict[str, Any]]:
    """Tiny FLUX.1 with two ControlNets (``FluxMultiControlNetModel``): one list of scales and images per call."""
    from diffusers import FluxControlNetPipeline, FluxMultiControlNetModel

    pipe, inputs = TINY["FLUX.1 ControlNet"]()
    second = TINY["FLUX.1 ControlNet"]()[0].controlnet
    torch.nn.init.normal_(second.controlnet_blocks[0].weight, std=0.2, generator=torch.Generator().manual_seed(2))
    multi = FluxMultiControlNetModel([pipe.controlnet, second])
    pipe = FluxControlNetPipeline(**{**pipe.components, "controlnet": multi})
    return pipe, {
        **inputs,
        "control_image": [_CONTROL, _CONTROL.flip(-1)],
        "controlnet_conditioning_scale": [1.0, 0.5],
    }


def _sd3_controlnet() -> tuple[Any, dict[str, Any]]:
    """Tiny SD3 with a ControlNet (``StableDiffusion3ControlNetPipeline``) and CFG."""
    from diffusers import SD3ControlNetModel, StableDiffusion3ControlNetPipeline

    base, inputs = TINY["SD3.5"]()
    config = base.transformer.config
    controlnet = live_controlnet(SD3ControlNetModel(
        sample_size=config.sample_size, in_channels=config.in_channels, out_channels=config.out_channels,
        num_layers=1, attention_head_dim=config.attention_head_dim, num_attention_heads=config.num_attention_heads,
        joint_attention_dim=config.joint_attention_dim, caption_projection_dim=config.caption_projection_dim,
        pooled_projection_dim=config.pooled_projection_dim, pos_embed_max_size=config.pos_embed_max_size,
    ))  # fmt: skip
    pipe = _with_controlnet(StableDiffusion3ControlNetPipeline, base, controlnet)
    return pipe, {**inputs, "guidance_scale": 4.0, "control_image": _CONTROL}


def _sana_controlnet() -> tuple[Any, dict[str, Any]]:
    """Tiny Sana with a ControlNet (``SanaControlNetPipeline``) and CFG."""
    from diffusers import SanaControlNetModel, SanaControlNetPipeline, SanaTransformer2DModel

    base, inputs = TINY["Sana"]()
    # Sana adds a ControlNet's sample i to the output of block i + 1: one block would never read one
    base.register_modules(transformer=SanaTransformer2DModel.from_config({**base.transformer.config, "num_layers": 2}))
    config = base.transformer.config
    controlnet = live_controlnet(SanaControlNetModel(
        in_channels=config.in_channels, out_channels=config.out_channels, num_attention_heads=2,
        attention_head_dim=config.attention_head_dim, num_layers=1, num_cross_attention_heads=2,
        cross_attention_head_dim=config.cross_attention_head_dim, cross_attention_dim=config.cross_attention_dim,
        caption_channels=config.caption_channels, sample_size=config.sample_size,
    ))  # fmt: skip
    pipe = _with_controlnet(SanaControlNetPipeline, base, controlnet)
    return pipe, {**inputs, "guidance_scale": 4.5, "control_image": _CONTROL}


def _in_a_wrapper(
    build: Callable[[], tuple[Any, dict[str, Any]]], conditions: int = 1, nets: int = 1
) -> Callable[[], tuple[Any, dict[str, Any]]]:
    """``build``'s tiny ControlNet pipeline with ``nets`` ControlNets (the second one built again, with weights of
    its own) inside its family's wrapper of several (``FluxMultiControlNetModel``, as InstantX's FLUX.1 Union
    ControlNet card loads one; SD3's; Qwen-Image's), called with ``conditions`` control images."""
    from diffusers import FluxMultiControlNetModel, QwenImageMultiControlNetModel, SD3MultiControlNetModel

    wrappers = {
        "Flux": FluxMultiControlNetModel,
        "SD3": SD3MultiControlNetModel,
        "Qwen": QwenImageMultiControlNetModel,
    }

    def in_a_wrapper() -> tuple[Any, dict[str, Any]]:
        pipe, inputs = build()
        controlnets = [pipe.controlnet]
        for seed in range(1, nets):
            controlnets.append(build()[0].controlnet)
            generator = torch.Generator().manual_seed(seed)
            for parameter in controlnets[-1].parameters():
                torch.nn.init.normal_(parameter, std=0.2, generator=generator)
        wrapper = next(cls for prefix, cls in wrappers.items() if type(pipe.controlnet).__name__.startswith(prefix))
        pipe = type(pipe)(**{**pipe.components, "controlnet": wrapper(controlnets)})
        images = [inputs["control_image"], inputs["control_image"].flip(-1)][:conditions]
        return pipe, {**inputs, "control_image": images}

    return in_a_wrapper


_CONTROLNETS = {
    "FLUX.1": TINY["FLUX.1 ControlNet"],
    "FLUX.1, two ControlNets": _flux_multi_controlnet,
    "FLUX.1, one ControlNet in a wrapper": _in_a_wrapper(TINY["FLUX.1 ControlNet"]),
    "Qwen-Image": _qwen_image_controlnet,
    "Qwen-Image, one ControlNet in a wrapper": _in_a_wrapper(_qwen_image_controlnet),
    "SD3": _sd3_controlnet,
    "SD3, one ControlNet in a wrapper": _in_a_wrapper(_sd3_controlnet),
    "SD3, two ControlNets": _in_a_wrapper(_sd3_controlnet, conditions=2, nets=2),
    "Qwen-Image, two conditions of one ControlNet": _in_a_wrapper(_qwen_image_controlnet, conditions=2),
    "Sana": _sana_controlnet,
}


@pytest.mark.filterwarnings("ignore:.*has no adapter")
@pytest.mark.parametrize("name", list(_CONTROLNETS))
def test_a_controlnet_is_captured_by_default_and_exact(name):
    """A ControlNet's forward runs as graphs by default (FLUX.1's gained 3-8% at 512², runs 221, 223). The scale is a
    Python float its forward multiplies every sample by, last: one ControlNet's is applied after its graphs, so one
    capture serves both scales, alone or in a wrapper of several, which serves every list of scales of one length
    (its graphs run each condition's ControlNet at scale 1.0; its scales and sum come after them)."""
    pipe, inputs = _CONTROLNETS[name]()
    scales = {"two": ([0.7, 0.5], [0.3, 0.5]), "wrapper": ([0.7], [0.3])}
    scales = next((pair for word, pair in scales.items() if word in name), (0.7, 0.3))
    calls = [{**inputs, "controlnet_conditioning_scale": scale} for scale in scales]

    def call(inputs):
        torch.manual_seed(0)  # SD3's pipeline encodes the conditioning image with a sample from the global generator
        return _call(pipe, inputs)

    with torch.no_grad():
        expected = [call(inputs) for inputs in calls]
    assert not torch.equal(*expected)  # the scale reaches the images: a replay of the wrong one would show
    accelerate(pipe, debug=True)
    try:
        for _ in range(2):
            assert all(torch.equal(call(inputs), want) for inputs, want in zip(calls, expected))
        report = assert_graphs_ran(pipe, components=("transformer", "controlnet"))
        assert report["components"]["controlnet"]["captures"] == 1, report["components"]
        assert CONTROLNET_SCALE in report["patches"], report["patches"]
    finally:
        restore(pipe)


def _controlnet_kwargs(pipe: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``pipe`` (eager) passes its ControlNet at the first step."""
    seen = []
    forward = pipe.controlnet.forward

    def recording(*args, **kwargs):
        seen.append(
            {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
        )
        return forward(*args, **kwargs)

    pipe.controlnet.forward = recording
    try:
        _call(pipe, inputs, steps=1)
    finally:
        del pipe.controlnet.forward
    return seen[0]


@pytest.mark.filterwarnings("ignore:.*has no adapter")
def test_one_controlnet_capture_serves_every_scale_and_a_direct_call():
    """One ControlNet's scale is applied after its graphs: new scales after the capture and the 0.0 a pipeline passes
    once ``control_guidance_end`` is past replay the one capture with eager's bytes; so do two direct calls of the
    ControlNet with their scales positional (one capture of their own: arguments by position are another
    signature); a scale given as a tensor is an input of a graph of its own."""
    pipe, inputs = TINY["FLUX.1 ControlNet"]()
    calls = [
        {**inputs, "controlnet_conditioning_scale": 0.7},
        {**inputs, "controlnet_conditioning_scale": 0.45, "control_guidance_end": 0.5},  # 0.0 at the second step
        {**inputs, "controlnet_conditioning_scale": 1.0},
    ]
    kwargs = _controlnet_kwargs(pipe, inputs)
    del kwargs["conditioning_scale"]
    head = [kwargs.pop(name) for name in ("hidden_states", "controlnet_cond", "controlnet_mode")]  # its first three

    def direct(scale):
        leaves, _ = tree.flatten(pipe.controlnet(*head, scale, **kwargs))
        return leaves

    scales = (0.6, 0.2, torch.tensor(0.35))
    with torch.no_grad():
        expected = [_call(pipe, call) for call in calls]
        expected_direct = [direct(scale) for scale in scales]
    assert len({image.sum().item() for image in expected}) == 3  # each scale reaches the image
    accelerate(pipe, debug=True)
    try:
        with torch.no_grad():
            for _ in range(2):
                assert all(torch.equal(_call(pipe, call), want) for call, want in zip(calls, expected))
            assert stats(pipe)["components"]["controlnet"]["captures"] == 1, stats(pipe)["components"]
            for scale, want in zip(scales, expected_direct):
                assert all(map(torch.equal, direct(scale), want))
        report = assert_graphs_ran(pipe, components=("transformer", "controlnet"))
        # + one for the direct calls' positional arguments (both floats), one for the tensor scale
        assert report["components"]["controlnet"]["captures"] == 3, report["components"]
        assert CONTROLNET_SCALE in report["patches"]
    finally:
        restore(pipe)


@pytest.mark.filterwarnings("ignore:.*has no adapter")
def test_flux_wrappers_graphs_serve_every_list_of_scales_of_one_length():
    """FLUX.1's Union ControlNet as InstantX's card loads it (one ControlNet in ``FluxMultiControlNetModel``): every
    scale of one condition, and the ``[0.0]`` after ``control_guidance_end``, replay one capture with eager's bytes;
    so do two conditions (the one ControlNet called for each, their samples summed after the graphs) at any two
    scales, from one capture of their own; a ControlNet whose forward is not the one read, swapped in after
    ``accelerate``, keys each list of scales."""
    from diffusers import FluxControlNetModel

    pipe, inputs = _CONTROLNETS["FLUX.1, one ControlNet in a wrapper"]()
    one = [
        {**inputs, "controlnet_conditioning_scale": [0.7]},
        {**inputs, "controlnet_conditioning_scale": [0.45], "control_guidance_end": 0.5},  # [0.0] at the second step
        {**inputs, "controlnet_conditioning_scale": [1.0]},
    ]
    pair = {**inputs, "control_image": [_CONTROL, _CONTROL.flip(-1)]}
    two = [
        {**pair, "controlnet_conditioning_scale": [0.7, 0.5]},
        {**pair, "controlnet_conditioning_scale": [0.2, 1.0]},
    ]
    with torch.no_grad():
        expected = [_call(pipe, call) for call in (*one, *two)]
    assert len({image.sum().item() for image in expected}) == 5  # each call's scales reach the image
    accelerate(pipe, debug=True)
    try:
        with torch.no_grad():
            for _ in range(2):
                assert all(torch.equal(_call(pipe, call), want) for call, want in zip(one, expected))
            assert stats(pipe)["components"]["controlnet"]["captures"] == 1, stats(pipe)["components"]
            for _ in range(2):
                assert all(torch.equal(_call(pipe, call), want) for call, want in zip(two, expected[3:]))
            assert stats(pipe)["components"]["controlnet"]["captures"] == 2, stats(pipe)["components"]
            forward = FluxControlNetModel.forward

            class Overriding(FluxControlNetModel):
                def forward(self, *args, **kwargs):
                    return forward(self, *args, **kwargs)

            pipe.controlnet.nets[0].__class__ = Overriding
            assert all(torch.equal(_call(pipe, call), want) for call, want in zip(one[::2], expected[::2]))
        report = assert_graphs_ran(pipe, components=("transformer", "controlnet"))
        # + [0.7] in the signature; [1.0] is the signature the one condition's capture was made with
        assert report["components"]["controlnet"]["captures"] == 3, report["components"]
    finally:
        restore(pipe)


@pytest.mark.filterwarnings("ignore:.*has no adapter")
@pytest.mark.parametrize("how", ["its class overrides the forward", "diffusers' forward changed"])
def test_a_controlnet_keeps_its_scale_in_the_signature_where_its_forward_is_not_the_one_read(how, monkeypatch):
    """A forward other than the one read (a subclass's own, or diffusers' code changed under us) may use the scale
    anywhere: the scale stays in the signature, each one its own capture, eager's bytes; changed code warns."""
    from diffusers import FluxControlNetModel

    pipe, inputs = TINY["FLUX.1 ControlNet"]()
    forward = FluxControlNetModel.forward
    warns = contextlib.nullcontext()
    if how == "its class overrides the forward":

        class Overriding(FluxControlNetModel):
            def forward(self, *args, **kwargs):
                return forward(self, *args, **kwargs)

        pipe.controlnet.__class__ = Overriding
    else:
        monkeypatch.setattr(
            FluxControlNetModel, "forward", lambda self, *args, **kwargs: forward(self, *args, **kwargs)
        )
        warns = pytest.warns(BCGWarning, match=r"controlnet scale \(FLUX.1\).*diffusers 0\.42")
    calls = [{**inputs, "controlnet_conditioning_scale": scale} for scale in (0.7, 0.3)]
    with torch.no_grad():
        expected = [_call(pipe, call) for call in calls]
    with warns:
        accelerate(pipe, debug=True)
    try:
        assert all(torch.equal(_call(pipe, call), want) for call, want in zip(calls, expected))
        report = assert_graphs_ran(pipe, components=("transformer", "controlnet"))
        assert report["components"]["controlnet"]["captures"] == 2 and CONTROLNET_SCALE not in report["patches"]
    finally:
        restore(pipe)


@pytest.mark.filterwarnings("ignore:.*has no adapter")
@pytest.mark.parametrize("name", ["FLUX.1", "FLUX.1, two ControlNets", "Qwen-Image"])
def test_fast_mode_compiles_a_controlnets_blocks_and_replays_their_bytes(name):
    """In fast mode a ControlNet's blocks (its transformer's block classes) compile, as the transformer's do
    (3.5% of FLUX.1's call with a six-block ControlNet at 512² and 1024², run 224); the graphs replay the bytes of
    the same compiled blocks without graphs; ``choose(controlnet, False)`` keeps them eager; restore undoes it."""
    pipe, inputs = _CONTROLNETS[name]()
    blocks = [m for m in pipe.controlnet.modules() if type(m).__name__ in pipe.transformer._repeated_blocks]
    assert blocks
    accelerate(pipe, mode="fast", debug=True)
    try:
        replayed = [_call(pipe, inputs) for _ in range(2)]
        with eager(pipe):
            compiled = _call(pipe, inputs)
        assert all(torch.equal(image, compiled) for image in replayed)
        report = assert_graphs_ran(pipe, components=("transformer", "controlnet"))
        assert report["controlnet_compiles"] >= 1 and COMPILED_CONTROLNET in report["patches"], report
        assert all("forward" in block.__dict__ for block in blocks)
    finally:
        restore(pipe)
    assert not any("forward" in block.__dict__ for block in blocks)  # the class's forwards back
    compiled_controlnet.choose(pipe.controlnet, False)
    accelerate(pipe, mode="fast", debug=True)
    try:
        _call(pipe, inputs)
        report = stats(pipe)
        assert report["controlnet_compiles"] == 0 and COMPILED_CONTROLNET not in report["patches"], report
    finally:
        restore(pipe)
    with pytest.raises(TypeError, match="True or False"):
        compiled_controlnet.choose(pipe.controlnet, "no")


@pytest.mark.filterwarnings("ignore:.*has no adapter")
def test_a_controlnet_stays_eager_when_left_out_of_components_or_hooked(caplog):
    pipe, inputs = TINY["FLUX.1 ControlNet"]()
    with torch.no_grad():
        expected = _call(pipe, inputs)
    accelerate(pipe, components=("transformer", "vae"), debug=True)
    try:
        assert torch.equal(_call(pipe, inputs), expected)
        assert "controlnet" not in stats(pipe)["components"]
    finally:
        restore(pipe)
    from diffusers.hooks.hooks import HookRegistry, ModelHook

    # A user's diffusers hook (offloading, a cache...) reads state per call: a defaulted ControlNet stays eager
    HookRegistry.check_if_exists_or_initialize(pipe.controlnet).register_hook(ModelHook(), "user's")
    with caplog.at_level("INFO", logger="bcg_diffusion.api"):
        accelerate(pipe, debug=True)
    try:
        assert torch.equal(_call(pipe, inputs), expected)
        assert "controlnet" not in stats(pipe)["components"] and "transformer" in stats(pipe)["components"]
        assert "controlnet stays eager: it has offload or diffusers hooks" in caplog.text
    finally:
        restore(pipe)


@pytest.mark.filterwarnings("ignore:.*has no adapter")
@pytest.mark.parametrize(
    ("build", "denoisers"),
    [
        (TINY["Wan 2.2 T2V"], ("transformer", "transformer_2")),
        (TINY["FLUX.1 ControlNet"], ("transformer", "controlnet")),
    ],
    ids=["Wan 2.2 experts", "FLUX.1 ControlNet"],
)
def test_every_denoiser_captures_again_under_another_diffusers_attention_backend(build, denoisers):
    """Diffusers' active attention backend (``attention_backend(...)``, process-wide) picks the kernels every
    processor dispatches to. Before, only ``transformer``'s graphs were keyed on it: Wan 2.2's second expert
    replayed the default backend's graph under another, and its image was not eager's."""
    pipe, inputs = build()
    with torch.no_grad():
        expected = _call(pipe, inputs)
        with attention_backend("_native_math"):
            expected_math = _call(pipe, inputs)
    assert not torch.equal(expected, expected_math)  # the backends round differently here: the test can fail
    accelerate(pipe, components=(*denoisers, "vae"), debug=True)
    try:
        assert torch.equal(_call(pipe, inputs), expected)
        with attention_backend("_native_math"):
            assert torch.equal(_call(pipe, inputs), expected_math)
        assert torch.equal(_call(pipe, inputs), expected)
        report = assert_graphs_ran(pipe, components=denoisers)
        assert all(report["components"][name]["captures"] == 2 for name in denoisers), report["components"]
    finally:
        restore(pipe)


@pytest.mark.heavy  # compiles the tiny encoders' layers with inductor on the CPU
@pytest.mark.filterwarnings("ignore:.*has no adapter")
@pytest.mark.parametrize("name", ["Wan 2.1 T2V", "FLUX.1"])
def test_fast_mode_compiles_t5_umt5_and_clip_layers_and_replays_their_bytes(name, monkeypatch):
    """Opted in, fast mode compiles the layers of Wan's UMT5 and of FLUX.1's CLIP and T5 (its ``text_encoder_2``,
    a feature instance of its own): a T5 block's self-attention and feed-forward layers, a CLIP layer's
    attention, norms and MLP. The graphs give the compiled layers' bytes; the image stays near eager's."""
    from bcg_diffusion.features import compiled_text_encoder
    from bcg_diffusion.features.compiled_text_encoder import COMPILED_TEXT_ENCODER, layer_parts

    monkeypatch.setattr(compiled_text_encoder, "_worth_compiling", lambda model: True)  # a GPU's choice, on a CPU
    pipe, inputs = _with_text_encoder(name)
    encoders = ("text_encoder", "text_encoder_2") if name == "FLUX.1" else ("text_encoder",)
    kinds = {type(part).__name__ for encoder in encoders for _, part in layer_parts(getattr(pipe, encoder))}
    expected_kinds = {"UMT5LayerSelfAttention", "UMT5LayerFF"} if name.startswith("Wan") else {
        "CLIPAttention", "LayerNorm", "CLIPMLP", "T5LayerSelfAttention", "T5LayerFF"}  # fmt: skip
    assert kinds == expected_kinds, kinds
    with torch.no_grad():
        expected = _call(pipe, inputs)
    accelerate(pipe, mode="fast", components=("transformer", "vae", *encoders), debug=True)
    try:
        fast = _call(pipe, inputs)
        with eager(pipe):  # the compiled layers without graphs: what fast mode must equal
            assert torch.equal(fast, _call(pipe, inputs))
        report = stats(pipe)
        for encoder in encoders:
            assert report[f"{encoder}_compiles"] > 0 and report[f"{encoder}_compile_failure"] is None, report
        assert COMPILED_TEXT_ENCODER in report["patches"]
        if name == "FLUX.1":
            assert f"{COMPILED_TEXT_ENCODER} (text_encoder_2)" in report["patches"]
        torch.testing.assert_close(fast, expected, atol=5e-2, rtol=0)
    finally:
        restore(pipe)
