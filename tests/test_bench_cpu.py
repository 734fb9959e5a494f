"""The benchmark's CPU smoke run: every output file and field is there (no speed is checked)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from bench import cli, report


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["--pipeline", "qwen-image", "--weights", "tiny", "--device", "cpu", "--resolutions", "32x32"]
    argv += ["--steps", "2", "--guidance", "4", "--batch", "2", "--prompts", "mixed", "--runs", "2"]
    argv += ["--modes", "eager,bcg", "--profile", "--out", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    return out, json.loads((out / "results.json").read_text())


def test_outputs_are_written(record):
    out, data = record
    assert (out / "results.md").read_text().startswith("`python -m bench")
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"torch", "diffusers", "device", "date"} <= set(data["environment"])
    assert "not meaningful" in (out / "results.md").read_text()


def test_case_fields(record):
    _, data = record
    (case,) = data["cases"]
    assert case["case"]["batch"] == 2 and case["label"].startswith("qwen-image 32x32")
    for name in ("eager", "bcg"):
        mode = case["modes"][name]
        assert len(mode["runs_s"]) == 2 and set(mode["latency_s"]) == {"median", "min", "max"}
        assert set(mode["stages_s"]) == {"encode", "denoise", "decode"}
        assert mode["first_call_s"] > 0 and mode["identical"] and len(mode["md5"]) == 32
        # every timed run is compared with eager's first call (eager's own runs too: not with themselves)
        assert mode["runs_identical"] == [True, True]
    profile = case["modes"]["bcg"]["denoise_profile"]  # on CPU: walls only, no kernel time
    assert profile["wall_s"] > 0 and profile["kernel_s"] == 0 and profile["kernel_share"] == {}
    graphs = case["modes"]["bcg"]["graphs"]
    # true CFG with two prompts of different lengths: cond, uncond (masked path) and the VAE
    assert graphs["captures"] == 3 and graphs["eager_fallbacks"] == 0
    # 4 calls (first, warm-up, 2 runs) x (2 steps x 2 transformer calls + 1 decode), less the 3 captures
    assert graphs["replays"] == 4 * 5 - 3


def _refused(capsys, main, argv) -> str:
    """``main(argv)`` stops with status 2 before building anything; returns what it printed to stderr."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


@pytest.fixture
def no_gpu(monkeypatch, tmp_path):
    """No CUDA GPU, whatever this machine has; building a pipeline or starting a child process fails the test;
    the current directory is an empty folder (nothing may be written to it)."""
    import subprocess

    from bench import hotswap, memory, serving

    def forbidden(*args, **kwargs):
        raise AssertionError("a pipeline was built (or a child started) on a machine without a GPU")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for module in (cli, hotswap, memory, serving):
        monkeypatch.setattr(module, "build_pipeline", forbidden)
    monkeypatch.setattr(subprocess, "run", forbidden)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [[], ["--pipeline", "z-image", "--weights", "Tongyi-MAI/Z-Image-Turbo"]])
def test_without_a_gpu_full_size_weights_stop_at_once_and_offer_the_smoke_run(no_gpu, capsys, argv):
    """The README's main job (``python -m bench``: random-full Z-Image) on a machine without a GPU says so
    before building anything, with the CPU smoke command to run instead, and exits with status 2."""
    started = time.perf_counter()
    err = _refused(capsys, cli.main, argv)
    assert time.perf_counter() - started < 5
    assert "needs an NVIDIA GPU with CUDA" in err and "Nothing was built" in err
    assert "\n    python -m bench --pipeline z-image --weights tiny\n" in err + "\n"
    err = _refused(capsys, cli.main, ["--pipeline", "qwen-image", "--pipeline", "z-image"])
    assert "python -m bench --pipeline qwen-image --pipeline z-image --weights tiny" in err


def test_python_m_bench_refuses_before_importing_the_pipelines(no_gpu, capsys, monkeypatch):
    """``python -m bench`` checks before it imports diffusers (seconds, not the ten or so of the imports), and
    leaves what it cannot tell to ``bench.cli``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from bench import runs

    assert runs.refuse_early([]) and "--pipeline z-image --weights tiny" in capsys.readouterr().err
    for argv in (["--help"], ["--preset", "issue2"], ["--weights", "tiny"], ["--pipeline"], ["--pipeline", "flux"]):
        assert not runs.refuse_early(argv), argv
    from bcg_diffusion.models import PIPELINE_NAMES

    assert runs.PIPELINES == PIPELINE_NAMES
    assert capsys.readouterr().err == ""
    monkeypatch.undo()  # the real subprocess.run, a process without a GPU
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(root)}
    code = "import runpy, sys\ntry:\n    runpy.run_module('bench', run_name='__main__')\nfinally:\n"
    code += "    print('diffusers imported:', 'diffusers' in sys.modules)\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=no_gpu, env=env, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "python -m bench --pipeline z-image --weights tiny" in done.stderr
    assert done.stdout == "diffusers imported: False\n"


def test_without_a_gpu_every_entry_point_refuses_full_size_weights(no_gpu, capsys):
    from bench import hotswap, memory, serving, warm_start

    for name, main in [("serving", serving.main), ("memory", memory.main), ("hotswap", hotswap.main)]:
        err = _refused(capsys, main, [])
        assert f"bench.{name}: --weights random-full" in err and f"python -m bench.{name} " in err
        assert "--weights tiny" in err
    err = _refused(capsys, warm_start.main, ["--profile"])
    assert "python -m bench.warm_start --pipeline z-image --weights tiny --device cpu" in err


def test_default_out_is_a_new_folder_git_ignores(monkeypatch):
    """A run never writes into the checkout by default: ``bench-runs/<pipeline>-<UTC timestamp>/`` under the
    current directory, which .gitignore covers."""
    import datetime
    import re
    from pathlib import Path

    from bench import runs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = cli.parse_args(["--pipeline", "qwen-image", "--weights", "tiny"])
    assert args.out.parent == Path("bench-runs") and re.fullmatch(r"qwen-image-\d{8}T\d{6}Z", args.out.name)
    assert cli.parse_args([]).out.name.startswith("z-image-")
    assert cli.parse_args(["--pipeline", "qwen-image", "--pipeline", "z-image"]).out.name.startswith(
        "qwen-image+z-image-"
    )
    assert cli.parse_args(["--out", "elsewhere"]).out == Path("elsewhere")
    moment = datetime.datetime(2026, 12, 1, 22, 30, 5, tzinfo=datetime.timezone(datetime.timedelta(hours=2)))
    assert runs.default_out("parallel", moment) == Path("bench-runs/parallel-20261201T203005Z")  # in UTC
    root = Path(__file__).resolve().parent.parent
    assert "/bench-runs/" in (root / ".gitignore").read_text().splitlines()


def test_exit_status_needs_graphs_that_ran():
    """A mode of ours passes only if its graphs were active, captured and replayed, with no eager
    fallback and no miss: an equality with eager proves nothing otherwise."""
    graphs = {"active": True, "captures": 3, "replays": 17, "eager_fallbacks": 0, "misses": 0}
    ok = {"identical": True, "graphs": graphs}
    assert cli._mode_ok("bcg", ok)
    for change in ({"active": False}, {"captures": 0}, {"replays": 0}, {"eager_fallbacks": 1}, {"misses": 2}):
        assert not cli._mode_ok("bcg", {**ok, "graphs": {**graphs, **change}}), change
    assert not cli._mode_ok("bcg", {"identical": True, "graphs": {}})
    assert not cli._mode_ok("bcg", {**ok, "identical": False})  # a timed run differed from eager
    assert not cli._mode_ok("bcg", {**ok, "identical": None})  # not compared: no eager reference
    assert cli._mode_ok("eager", {"identical": True}) and not cli._mode_ok("eager", {"identical": False})
    assert not cli._mode_ok("fast", {"graphs": graphs, "identical_to_reference": False})
    assert not cli._mode_ok("fast", {"graphs": {**graphs, "replays": 0}, "identical_to_reference": True})
    assert cli._mode_ok("compile", {"identical": False}) and cli._mode_ok("compile", {"error": "x"})  # peers


def test_timed_call_puts_back_the_instances_encode_prompt():
    """Timing wraps ``encode_prompt`` on the instance; the wrapper text buckets installed there stays."""
    from bcg_diffusion import accelerate, restore
    from bcg_diffusion.models import build_pipeline
    from bench.cases import Case
    from bench.measure import timed_call

    pipe = build_pipeline("qwen-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    case, cpu = Case("qwen-image", 32, 32, steps=2, guidance=0.0), torch.device("cpu")
    timed_call(pipe, case, cpu)
    assert "encode_prompt" not in pipe.__dict__  # none before, none after
    accelerate(pipe, debug=True, text_buckets=(32,))
    try:
        padded = pipe.__dict__["encode_prompt"]
        assert timed_call(pipe, case, cpu).encode_s > 0
        assert pipe.__dict__["encode_prompt"] is padded
    finally:
        restore(pipe)
    assert "encode_prompt" not in pipe.__dict__


def test_verdict_says_plainly_when_a_peer_beats_bcg():
    case = {"modes": {"eager": {"latency_s": {"median": 2.0}}, "bcg": {"latency_s": {"median": 1.2}}}}
    assert "Fastest: **bcg**" in report.verdict(case)
    case["modes"]["compile"] = {"latency_s": {"median": 1.0}}
    assert "compile beats bcg by 20%" in report.verdict(case)


@pytest.mark.parametrize("argv", [["--modes", "turbo"], ["--resolutions", "512"], ["--runs", "0"]])
def test_bad_arguments_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_memory_report_fields(tmp_path):
    from bench import memory

    assert (
        memory.main(["--weights", "tiny", "--device", "cpu", "--resolutions", "64x64,48x96", "--out", str(tmp_path)])
        == 0
    )
    result = json.loads((tmp_path / "memory.json").read_text())
    assert result["largest_resolution"] == [48, 96]
    # Per resolution: the VAE and a transformer signature per CFG mode (Z-Image's CFG doubles the batch);
    # and one text-encoder signature (its prompts are padded to one length) on each side.
    assert result["single"]["signatures"] == 3 and result["all"]["signatures"] == 7
    assert {"pool_bytes", "per_signature_bytes"} <= set(result["all"])
    assert {"peak_eager_bytes", "peak_replay_bytes", "pool_ratio_all_over_single"} <= set(result)


@pytest.mark.heavy  # starts torchrun: two processes, each importing torch
def test_parallel_bench_under_torchrun(tmp_path):
    """``torchrun -m bench.parallel`` on two CPU processes (gloo, debug mode): the launch recipe works,
    both layouts are measured, bcg equals eager in each, and rank 0 writes the report."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "bench.parallel"]
    command += ["--weights", "tiny", "--resolutions", "64x64", "--steps", "2", "--runs", "1", "--forward-runs", "2"]
    command += ["--out", str(tmp_path)]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(command, timeout=300, cwd=root, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((tmp_path / "parallel.json").read_text())
    assert result["layout"] == "ulysses=2" and result["world_size"] == 2
    for layout in ("single", "parallel"):
        case = result[layout]["64x64"]
        assert case["bcg"]["images_equal"] and case["bcg"]["forward_equal"], case
        assert case["bcg"]["graphs"]["eager_fallbacks"] == 0
    assert (tmp_path / "parallel.md").read_text().startswith("`torchrun -m bench.parallel")


@pytest.mark.heavy  # starts torchrun: two processes, each importing torch
def test_parallel_bench_splits_cfg_across_two_processes(tmp_path):
    """``torchrun -m bench.parallel --parallel cfg`` on two CPU processes (gloo, debug mode): the
    split gives one process's bytes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "bench.parallel"]
    command += ["--weights", "tiny", "--resolutions", "64x64", "--steps", "3", "--runs", "1", "--parallel", "cfg"]
    command += ["--single-modes", "bcg", "--cfg-modes", "bcg", "--out", str(tmp_path)]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(command, timeout=300, cwd=root, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((tmp_path / "parallel.json").read_text())
    assert result["layout"] == "cfg" and result["parallel"]["64x64"]["bcg"]["images_equal_to_one_gpu"], result
    assert "CFG across GPUs" in (tmp_path / "parallel.md").read_text()


def test_serving_report_fields(tmp_path):
    """``python -m bench.serving`` on tiny Qwen-Image: text buckets cover every random prompt after
    the warm-up (no capture, no miss), and the checked requests equal eager."""
    from bench import serving

    argv = ["--pipeline", "qwen-image", "--weights", "tiny", "--device", "cpu", "--resolutions", "32x32"]
    argv += ["--requests", "4", "--steps", "2", "--check", "2", "--out", str(tmp_path)]
    assert serving.main(argv) == 0
    result = json.loads((tmp_path / "serving.json").read_text())
    assert result["captures_during_requests"] == 0 and result["misses"] == 0
    assert result["warmup"]["captures"] > 0 and len(result["checks"]) == 2
    assert {"median", "p90", "max"} <= set(result["latency_s"])
    assert "0 captures" in (tmp_path / "serving.md").read_text()


def test_kernel_kinds():
    from bench.measure import kernel_kind

    assert kernel_kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wmma_f16") == "attention"
    assert kernel_kind("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32") == "convolution"
    assert kernel_kind("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "other"


def test_compile_max_outputs_are_cloned_with_their_structure():
    """The reduce-overhead peer clones what the compiled forward returns (true CFG keeps the cond output
    across the uncond call, whose CUDA graph would overwrite it)."""
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    from bench.modes import _cloned

    first, second = torch.ones(2), torch.zeros(3)
    for value in ((first,), [first, second], Transformer2DModelOutput(sample=first)):
        copied = _cloned(value)
        assert type(copied) is type(value)
        leaves = list(copied.values()) if isinstance(copied, Transformer2DModelOutput) else list(copied)
        originals = list(value.values()) if isinstance(value, Transformer2DModelOutput) else list(value)
        for got, original in zip(leaves, originals, strict=True):
            assert torch.equal(got, original) and got.data_ptr() != original.data_ptr()
    assert _cloned(None) is None


def test_cached_modes_compare_with_eager_and_the_cache(tmp_path):
    argv = ["--pipeline", "z-image", "--weights", "tiny", "--device", "cpu", "--resolutions", "32x32", "--steps", "8"]
    argv += ["--modes", "eager,eager+cache,bcg+cache", "--runs", "1", "--warmup", "0", "--out", str(tmp_path)]
    assert cli.main([*argv, "--no-progress"]) == 0
    (case,) = json.loads((tmp_path / "results.json").read_text())["cases"]
    cached, ours = case["modes"]["eager+cache"], case["modes"]["bcg+cache"]
    assert cached["baseline"] == ours["baseline"] == "eager+cache" and case["modes"]["eager"]["baseline"] == "eager"
    assert ours["identical"] and cached["identical"]  # against eager+cache's first call
    assert 0 < ours["cache_skipped"]["skipped"] < ours["cache_skipped"]["calls"], ours["cache_skipped"]
    assert ours["cache_skipped"] == cached["cache_skipped"] and ours["speedup_vs_eager_cache"] > 0
    assert ours["graphs"]["cache_states"] > 0 and "MagCache" in ours["cache"]
    assert "cache skipped" in (tmp_path / "results.md").read_text()


def test_a_pipeline_copy_keeps_the_pipeline_settings_and_copies_a_second_expert():
    # pipeline_copy rebuilt pipelines from their components only: a Wan 2.2 copy lost boundary_ratio
    # (and so ran its first expert at every step) and shared its second expert with the original.
    from bench.coverage_models import TINY
    from bench.modes import pipeline_copy

    pipe, _ = TINY["Wan 2.2 T2V"]()
    clone = pipeline_copy(pipe)
    assert clone.config.boundary_ratio == pipe.config.boundary_ratio is not None
    assert clone.transformer_2 is not pipe.transformer_2
    first = next(pipe.transformer_2.parameters())
    assert next(clone.transformer_2.parameters()).data_ptr() == first.data_ptr()  # weights shared
