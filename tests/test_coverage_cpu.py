"""Diffusers pipelines beyond the two we tune (bench.coverage). Tiny, on the CPU in debug mode: the runner
takes them, gives eager's bytes, and reports what a capture would meet outside the breaks. Published
sizes, on the meta device: the configs are accepted by the classes, have the published sizes, and the
call arguments fit them (they run on a GPU only).

Debug mode counts captures and replays as graphs do: each transformer of a pipeline must have replayed
itself, with no eager fallback, miss or failed signature (the VAE's replays alone do not pass)."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from _checks import assert_report_ran, recorded_stats
from diffusers import WanTransformer3DModel

import bench.coverage as coverage
from bench.coverage import check, check_tiny, main, parameter_counts, timing_table
from bench.coverage_models import FULL, TINY, _random_model

# Models a pipeline calls that no runner holds: the runner knows transformer, vae and text_encoder only.
LEFT_EAGER: dict[
    str, list[str]
] = {}  # pipeline -> models no runner holds (none since Wan 2.2's transformer_2 got one)

# Transformer parameters of each published config, in billions, to 1% (the sizes the model cards
# announce in brackets); Wan 2.2's two experts together.
PUBLISHED_BILLIONS = {
    "FLUX.1": 11.90,  # 12B
    "Chroma": 8.90,  # 8.9B
    "SD3.5": 8.06,  # Large: 8.1B
    "Lumina 2": 2.61,  # 2.6B
    "Wan 2.1 T2V": 14.29,  # 14B
    "CogVideoX": 5.57,  # 5B
    "Qwen-Image Edit": 20.43,  # 20B
    "Qwen-Image Edit Plus": 20.43,  # 20B
    "FLUX.1 Kontext": 11.90,  # 12B
    "FLUX.1 ControlNet": 11.90,  # FLUX.1-dev's 12B (the ControlNet is not a transformer component)
    "FLUX.2": 32.22,  # 32B
    "FLUX.2 klein": 3.88,  # 4B
    "Wan 2.2 T2V": 28.58,  # A14B: two 14B experts
    "HunyuanVideo": 12.82,  # 13B
    "LTX-Video": 1.92,  # 2B
    "Sana": 1.60,  # 1.6B
    "HunyuanImage": 17.43,  # 2.1: 17B
}
# Where each transformer class keeps the width of the text embeddings it takes.
TEXT_WIDTH_KEYS = ("joint_attention_dim", "text_dim", "caption_channels", "cap_feat_dim", "text_embed_dim")


@functools.cache
def _tiny_run(name):
    """One debug run per pipeline, shared by the tests below: ``check_tiny``'s row and the ``stats`` report it
    took before restoring the pipeline."""
    with recorded_stats(coverage) as reports:
        row = check_tiny(name)
    [report] = reports
    return row, report


def _tiny_row(name):
    return _tiny_run(name)[0]


@functools.cache
def _meta_pipe(name):
    return FULL[name].build(torch.device("meta"))


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_pipeline_runs_the_runner_path_and_equals_eager(name):
    row = _tiny_row(name)
    assert row["active"], row["reason"]
    assert row["identical"], row
    assert row["replays"] > 0 and row["signatures"] >= 2, row  # transformer and VAE at least
    report = _tiny_run(name)[1]
    transformers = sorted(c for c in report["components"] if c.startswith("transformer"))  # Wan 2.2: two
    assert "transformer" in transformers and "vae" in report["components"], sorted(report["components"])
    assert_report_ran(report, captures=True, components=[*transformers, "vae"])  # each replayed by itself
    assert all(" at " in op and "(" in op for op in row["hostile_ops"]), row["hostile_ops"]
    assert set(row["not_accelerated"]) <= set(LEFT_EAGER.get(name, ())), row  # no gap beyond the known ones


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=f"{', '.join(LEFT_EAGER[name])} stays eager"))
        if name in LEFT_EAGER
        else name
        for name in TINY
    ],
)
def test_tiny_pipeline_has_every_model_it_calls_accelerated(name):
    assert not _tiny_row(name)["not_accelerated"]  # strict: passing where a gap is known fails, to update LEFT_EAGER


def test_the_full_and_tiny_tables_name_the_same_pipelines():
    assert list(FULL) == list(TINY)


@pytest.mark.parametrize("name", list(FULL))
def test_published_config_builds_on_meta_with_its_published_size(name):
    pipe = _meta_pipe(name)
    counts = parameter_counts(pipe)
    transformers = sum(n for component, n in counts.items() if component.startswith("transformer"))
    assert transformers / 1e9 == pytest.approx(PUBLISHED_BILLIONS[name], rel=0.01), counts
    assert all(p.device.type == "meta" for p in pipe.transformer.parameters())


@pytest.mark.parametrize("name", list(FULL))
def test_published_call_arguments_fit_the_pipeline_and_its_transformer(name):
    spec, pipe = FULL[name], _meta_pipe(name)
    accepted = inspect.signature(type(pipe).__call__).parameters
    config = pipe.transformer.config
    width = next(config[key] for key in TEXT_WIDTH_KEYS if key in config)
    assert len(spec.sizes) == 2  # a launch-bound and a GPU-bound size
    for size in spec.sizes:
        inputs = spec.inputs(torch.device("meta"), size)
        assert set(inputs) <= set(accepted), set(inputs) - set(accepted)
        assert (inputs["width"], inputs["height"], inputs.get("num_frames")) == size[1:]
        for key in ("prompt_embeds", "negative_prompt_embeds"):
            if key in inputs:
                assert inputs[key].shape[-1] == width and inputs[key].dtype == torch.bfloat16, key
        if "pooled_prompt_embeds" in inputs:
            assert inputs["pooled_prompt_embeds"].shape[-1] == config["pooled_projection_dim"]


def test_random_models_are_deterministic_per_name_and_keep_fp32_modules_as_from_pretrained_does():
    def build(name):
        factory = functools.partial(
            WanTransformer3DModel, num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
            text_dim=32, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
        )  # fmt: skip
        return _random_model(factory, name, torch.device("cpu"))

    first, again, other = build("transformer"), build("transformer"), build("transformer_2")
    keep = set(WanTransformer3DModel._keep_in_fp32_modules)
    for (name, param), same, different in zip(first.named_parameters(), again.parameters(), other.parameters()):
        assert param.dtype == (torch.float32 if keep & set(name.split(".")) else torch.bfloat16), name
        assert torch.equal(param, same), name
        if param.ndim >= 2:  # matrices are random; biases and norm scales are constants
            assert not torch.equal(param, different), name
    assert not first.training


def test_check_times_a_tiny_pipeline_and_renders_its_row():
    result = check("FLUX.1", "tiny", "cpu", runs=1, modes=("exact",))
    case = result["cases"]["tiny 32x32"]
    assert case["eager"]["deterministic"] and case["exact"]["identical"], case
    assert case["exact"]["graphs"]["active"] and case["exact"]["not_accelerated"] == []
    assert {s["component"] for s in case["exact"]["graphs"]["signatures"]} == {"transformer", "vae"}
    replays = {s["component"]: s["replays"] for s in case["exact"]["graphs"]["signatures"]}
    assert replays["transformer"] > 0 and replays["vae"] > 0, replays  # each replayed, not the VAE alone
    assert case["exact"]["graphs"]["eager_fallbacks"] == 0, case["exact"]["graphs"]
    assert "outputs" not in case["eager"] and "fast" not in case
    assert "| FLUX.1 | tiny 32x32 | debug (no graphs) |" in timing_table([result])


def test_full_size_is_refused_without_a_gpu(capsys):
    assert main(["--size", "full", "--pipelines", "FLUX.1"]) == 2
    assert "--device cuda" in capsys.readouterr().err
