"""The benchmark's CPU smoke run: every output file and field is there (no speed is checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import cli, report
from bench.timing import profiled

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["--pipeline", "qwen-image", "--weights", "tiny", "--device", "cpu", "--resolutions", "32x32"]
    argv += ["--steps", "2", "--guidance", "4", "--batch", "2", "--prompts", "mixed", "--runs", "2"]
    argv += ["--modes", "eager,bcg,bcg-no-auto", "--profile", "--out", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    return out, json.loads((out / "results.json").read_text())


def test_outputs_are_written(record):
    out, data = record
    assert (out / "results.md").read_text().startswith("`python -m bench")
    assert data["stage_syncs"] is False and "Stages: host time (a CPU run)." in (out / "results.md").read_text()
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
    for name in ("eager", "bcg", "bcg-no-auto"):  # --profile profiles every mode its name sets up
        profile = case["modes"][name]["denoise_profile"]  # on CPU: walls only, no kernel time
        assert profile["wall_s"] > 0 and profile["kernel_s"] == 0 and profile["kernel_share"] == {}
    graphs = case["modes"]["bcg"]["graphs"]
    # true CFG with two prompts of different lengths: cond, uncond (masked path) and the VAE
    assert graphs["captures"] == 3 and graphs["eager_fallbacks"] == 0
    # 4 calls (first, warm-up, 2 runs) x (2 steps x 2 transformer calls + 1 decode), less the 3 captures
    assert graphs["replays"] == 4 * 5 - 3


def test_profile_takes_every_mode_its_name_sets_up():
    # Before, only eager, bcg and fast: `--modes fast-fp8-attn --profile` profiled nothing, and said nothing
    assert all(map(profiled, ("eager", "bcg-no-auto", "fast-fp8-attn", "fast-no-te", "compile")))
    assert not any(map(profiled, ("fast+cache", "bcg+cachedit", "fast-te", "compile-max")))


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
    from bench import hotswap, memory, serving, timing

    def forbidden(*args, **kwargs):
        raise AssertionError("a pipeline was built (or a child started) on a machine without a GPU")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for module in (timing, hotswap, memory, serving):
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


def test_python_m_bench_refuses_before_importing_the_pipelines(no_gpu, monkeypatch):
    """``python -m bench`` checks before it imports diffusers (seconds, not the ten or so of the imports)."""
    from bcg_diffusion.models import PIPELINE_NAMES
    from bench import runs

    assert runs.PIPELINES == PIPELINE_NAMES  # what the command line offers without importing diffusers
    monkeypatch.undo()  # the real subprocess.run, a process without a GPU
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
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


def test_the_report_says_how_the_stages_were_timed():
    from bench.report import _stages_note

    gpu = {"environment": {"device": "NVIDIA H200"}}
    assert "CUDA events" in _stages_note(gpu | {"stage_syncs": False})
    assert "--stage-syncs" in _stages_note(gpu | {"stage_syncs": True})
    assert "CPU" in _stages_note({"environment": {"device": "cpu"}, "stage_syncs": False})


def test_timed_call_with_stage_syncs_splits_the_same_call_in_host_time():
    from bcg_diffusion.models import build_pipeline
    from bench.cases import Case
    from bench.measure import timed_call

    pipe = build_pipeline("z-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    case, cpu = Case("z-image", 32, 32, steps=2, guidance=0.0), torch.device("cpu")
    plain, synced = timed_call(pipe, case, cpu), timed_call(pipe, case, cpu, stage_syncs=True)
    assert torch.equal(plain.images, synced.images)
    for timing in (plain, synced):
        assert timing.encode_s > 0 and timing.denoise_s > 0 and timing.decode_s >= 0
        assert timing.encode_s + timing.denoise_s + timing.decode_s <= timing.total_s


def test_verdict_says_plainly_when_a_peer_beats_bcg():
    case = {"modes": {"eager": {"latency_s": {"median": 2.0}}, "bcg": {"latency_s": {"median": 1.2}}}}
    assert "Fastest: **bcg**" in report.verdict(case)
    case["modes"]["compile"] = {"latency_s": {"median": 1.0}}
    assert "compile beats bcg by 20%" in report.verdict(case)


@pytest.mark.parametrize(
    "argv", [["--modes", "turbo"], ["--resolutions", "512"], ["--runs", "0"], ["--cachedit-mask", "01x"]]
)
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


def _python_m_bench(argv: list[str], cwd: Path, *, module: str = "bench", columns: int = 250, timeout: int = 300):
    """``python -m <module> argv`` in a fresh process without a GPU, from ``cwd``."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "COLUMNS": str(columns)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", module, *argv]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _one_line_error(err: str, prog: str = "python -m bench") -> str:
    """The single ``prog: error: ...`` line that ends ``err`` (argparse's convention: usage, then one line)."""
    assert "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert [line for line in lines if "error:" in line] == lines[-1:], err[-3000:]
    assert lines[-1].startswith(f"{prog}: error: "), err[-3000:]
    return lines[-1]


CLI_ERRORS = [
    pytest.param(["--resolutions", "500x500"], "500x500: both sides must be multiples of 16", id="resolution"),
    pytest.param(["--modes", "eager,turbo"], "turbo", id="unknown-mode"),
    pytest.param(["--modes", ","], "no mode", id="no-mode"),
    pytest.param(["--steps", "1"], "--steps", id="steps"),
    pytest.param(["--preset", "fastest"], "fastest", id="unknown-preset"),
    pytest.param(["--device", "gpu"], "--device", id="bad-device"),
    pytest.param(
        ["--device", "cuda"],
        "no CUDA",
        id="cuda-on-a-cpu-build",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a CUDA GPU"),
    ),
]


@pytest.mark.parametrize("argv, expected", CLI_ERRORS)
def test_a_command_line_error_is_one_line_and_exit_status_2(tmp_path, argv, expected):
    """Every mistake on ``python -m bench``'s command line, including those found after parsing (a resolution the
    pipelines cannot take, ``--device cuda`` on a CPU build), is argparse's usage plus one line, status 2."""
    done = _python_m_bench(["--weights", "tiny", *argv], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stdout == ""
    assert expected in _one_line_error(done.stderr)
    assert not any(tmp_path.iterdir())  # nothing was built or written


def test_a_pipeline_that_cannot_be_built_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    from bench import timing

    def unavailable(name, weights, **kwargs):
        raise OSError(f"{weights} is not a local folder\nand not a model id on the hub")

    monkeypatch.setattr(timing, "build_pipeline", unavailable)
    argv = ["--weights", "tiny", "--device", "cpu", "--runs", "1", "--no-progress", "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "cannot build z-image (tiny) on cpu: tiny is not a local folder and not a model id" in line


def test_help_is_quick_shows_every_default_the_presets_and_the_modes_a_user_picks(tmp_path):
    """``python -m bench --help`` imports neither torch nor diffusers (it took 6.5 s when it did); it gives every
    option's default, names presets by what they run and lists the modes a user picks, one line each, the GPU
    and the CPU default; ``--list-modes`` lists every mode, each once."""
    from bench.catalog import PUBLISHED_DEFAULT_MODES, USER_MODES
    from bench.modes import DEFAULT_MODES, MODES

    code = (
        "import runpy, sys\nsys.argv = ['bench', '--help']\ntry:\n    runpy.run_module('bench', run_name='__main__')\n"
    )
    code += "finally:\n    print('IMPORTED', sorted({'torch', 'diffusers', 'bcg_diffusion'} & set(sys.modules)))\n"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "COLUMNS": "100", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.endswith("IMPORTED []\n"), done.stdout[-500:]
    text = " ".join(done.stdout.split())  # argparse wraps lines
    section = done.stdout.split("modes (--modes):\n")[1].split("\n\n")[0].splitlines()
    listed = [line.split()[0] for line in section]
    assert listed == list(USER_MODES) and len(USER_MODES) <= 12, section  # one line each: no continuation
    assert "--list-modes lists and describes them all" in text
    everything = cli.mode_listing()
    for name in MODES:
        assert everything.count(f"\n  {name} ") + everything.startswith(f"  {name} ") <= 1, name
        assert f"  {name} " in everything, name
    published = ",".join(PUBLISHED_DEFAULT_MODES)
    expected = f"default on a GPU: {','.join(DEFAULT_MODES)}; for the published pipelines (flux, wan...): {published};"
    assert f"{expected} on a CPU: eager,bcg" in text
    assert "two-sizes" in text and "cfg-steps-batch" in text and "issue2" not in text and "issue3" not in text
    for default in ("(default: 5)", "(default: 512x512;", "(default: random-full)", "(default: magcache)"):
        assert default in text, default
    assert "Traceback" not in done.stderr


def test_every_option_shows_its_default():
    parser = cli.build_parser()
    formatter = parser.formatter_class(prog=parser.prog)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert "default" in formatter._get_help_string(action), action.option_strings


def test_old_preset_names_that_records_cite_still_run_their_cases():
    """``--preset issue2`` is what ``docs/results.md`` and run 6's record cite: a hidden alias of the new name."""
    from bench.cases import PRESETS

    assert cli.parse_args(["--preset", "issue2", "--weights", "tiny"]).preset == "cfg-steps-batch"
    assert set(PRESETS) == {"two-sizes", "cfg-steps-batch"}
    assert "issue2" not in cli.build_parser().format_help()


def test_log_lines_print_above_the_progress_bar(tmp_path):
    """With the progress bar on, every log line starts a line of its own: none is written after the bar's text
    (tqdm's logging redirect clears the bar, prints the line, and draws the bar again)."""
    import re

    argv = ["--pipeline", "z-image", "--weights", "tiny", "--device", "cpu", "--resolutions", "32x32"]
    argv += ["--steps", "2", "--runs", "1", "--warmup", "0", "--modes", "eager,bcg", "--out", str(tmp_path / "out")]
    done = _python_m_bench(argv, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    pieces = re.split(r"[\r\n]", done.stderr)
    assert any(re.match(r"bench: +\d+%\|", piece) for piece in pieces), done.stderr[-3000:]  # the bar was drawn
    logged = [piece for piece in pieces if " INFO bench: " in piece]
    assert any("built z-image" in piece for piece in logged), done.stderr[-3000:]
    for piece in logged:
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO bench: ", piece), piece


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a CUDA GPU")
ENTRY_POINT_ERRORS = [
    pytest.param("serving", ["--resolutions", "500x500", "--requests", "1", "--steps", "2"], "multiples of 16"),
    pytest.param("serving", ["--device", "cuda"], "no CUDA", marks=NO_CUDA),
    pytest.param("memory", ["--resolutions", "64x60"], "64x60: both sides must be multiples of 16"),
    pytest.param("memory", ["--device", "cuda"], "no CUDA", marks=NO_CUDA),
    pytest.param("hotswap", ["--resolution", "512"], "--resolution"),
    pytest.param("hotswap", ["--modes", "exact,turbo"], "--modes"),
    pytest.param("hotswap", ["--swaps", "0"], "--swaps"),
    pytest.param("warm_start", ["--size", "500"], "--size"),
    pytest.param("warm_start", ["--device", "cuda"], "no CUDA", marks=NO_CUDA),
    pytest.param("coverage", ["--device", "gpu"], "--device"),
    pytest.param("parallel", [], "torchrun"),
]


@pytest.mark.parametrize("name, argv, expected", ENTRY_POINT_ERRORS)
def test_every_entry_point_reports_a_mistake_in_one_line(name, argv, expected, capsys, monkeypatch, tmp_path):
    """The companions follow ``python -m bench``: a mistake in the arguments, found while parsing or after, is
    usage and one line with exit status 2, before anything is built (``bench.parallel`` checks before torchrun's
    rendezvous, so it says to use torchrun rather than failing to find one)."""
    import importlib

    module = importlib.import_module(f"bench.{name}")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        module.main(["--weights", "tiny", *argv] if name != "coverage" else argv)
    assert stopped.value.code == 2
    prog = "torchrun --nproc_per_node=N -m bench.parallel" if name == "parallel" else f"python -m bench.{name}"
    assert expected in _one_line_error(capsys.readouterr().err, prog)
    assert not any(tmp_path.iterdir())


def test_a_gpu_index_this_machine_lacks_is_a_mistake(monkeypatch):
    from bench import runs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert runs.device_problem("cuda:1") == "--device cuda:1: this machine has 1 CUDA GPU (cuda:0 to cuda:0)"
    assert runs.device_problem("cuda:0") is runs.device_problem("cuda") is runs.device_problem("cpu") is None


def test_cachedit_mask_computes_about_half_and_takes_a_spec():
    from bench.caching import cachedit_mask

    mask = cachedit_mask(50)
    assert len(mask) == 50 and mask[:5] == [1] * 5 and mask[-1] == 1 and 20 <= sum(mask) <= 30
    assert cachedit_mask(5, "10") == [1, 0, 1, 0, 1]
    with pytest.raises(ValueError, match="0 and 1"):
        cachedit_mask(4, "1x")


def test_cachedit_modes_compare_with_eager_cachedit():
    from bench.catalog import CACHEDIT, DEFAULT_MODES, EXACT, baseline

    assert all(baseline(m) == "eager+cachedit" for m in CACHEDIT)
    assert EXACT["bcg+cachedit"] and not EXACT["fast+cachedit"]
    assert not set(CACHEDIT) & set(DEFAULT_MODES)


@pytest.mark.parametrize("cache", ["magcache", "cachedit"])
def test_warm_start_children_enable_the_benchmark_cache_before_accelerate(cache):
    # bench.warm_start --cache: every child times its first call with the cache on (fresh processes), so the
    # first call with a cache can be set against one without.
    from bcg_diffusion.features.step_caching import cache_dit_enabled, cache_hooks
    from bcg_diffusion.models import build_pipeline
    from bench import warm_start

    if cache == "cachedit":
        pytest.importorskip("cache_dit")
    pipe = build_pipeline("qwen-image", "tiny")
    warm_start._enable_cache(pipe, cache, 4)
    if cache == "cachedit":
        assert cache_dit_enabled(pipe.transformer)
    else:
        assert cache_hooks(pipe.transformer)


def test_every_mode_name_parses_to_a_base_mode_and_its_options():
    """A suffix that prepare() did not know once made fast-fp8-torchao-ff run as plain bf16 fast mode (run 99):
    every name must leave a base mode, and each FP8 mode must quantize."""
    from bench import modes

    for name in modes.MODES:
        options = modes.parse(name)
        assert options.base in modes.BASES
        assert options.fp8 == (name in modes.FP8_MODES), name
        assert options.cache == (name in modes.CACHED) and options.cachedit == (name in modes.CACHEDIT), name
    assert modes.parse("fast-fp8-torchao-ff") == modes.ModeOptions("fast", fp8=True, torchao_feed_forward=True)
    assert modes.parse("fast-fp8-attn") == modes.ModeOptions("fast", fp8=True, fp8_attention=True)
    assert modes.parse("fast-fp8-attn-triton") == modes.ModeOptions(
        "fast", fp8=True, fp8_attention=True, triton_attention=True
    )
    assert modes.parse("fast-fp8-attn+cache") == modes.ModeOptions("fast", cache=True, fp8=True, fp8_attention=True)
    assert modes.parse("fast-fp8-inductor-glue") == modes.ModeOptions("fast", fp8=True, inductor_glue=True)
    assert modes.parse("fast-fp8-attn-bf16-prologue") == modes.ModeOptions(
        "fast", fp8=True, fp8_attention=True, bf16_prologue=True
    )
    assert modes.parse("fast-fp8-all-linears-attn-scaled-output") == modes.ModeOptions(
        "fast", fp8=True, fp8_attention=True, all_linears=True, scaled_output=True
    )
    with pytest.raises(ValueError, match="unknown mode"):
        modes.parse("fast-fp9")


def test_a_catalogued_mode_with_an_unknown_suffix_is_refused(monkeypatch):
    from bench import modes

    monkeypatch.setattr(modes, "MODES", (*modes.MODES, "fast-fp8-torchao-gelu"))
    with pytest.raises(ValueError, match="not a base mode"):
        modes.parse("fast-fp8-torchao-gelu")


def test_the_benchmark_runs_from_any_directory_once_installed(tmp_path):
    """``python -m bench`` and ``bcg-bench`` work outside the checkout: the installed package holds ``bench``."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and "modes (--modes)" in done.stdout, done.stderr[-2000:]
    script = Path(sys.executable).with_name("bcg-bench")
    if script.exists():  # installed as a console script by `pip install -e .`
        done = subprocess.run([str(script), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0 and "modes (--modes)" in done.stdout, done.stderr[-2000:]


def _teardowns_wrapped(monkeypatch, wrap) -> None:
    """The benchmark's modes prepared as they are, each one's teardown replaced by ``wrap(name, mode, teardown)``."""
    from bench import timing

    real_prepare = timing.prepare

    def prepare(name, *args, **kwargs):
        mode = real_prepare(name, *args, **kwargs)
        mode.teardown = wrap(name, mode, mode.teardown)
        return mode

    monkeypatch.setattr(timing, "prepare", prepare)


def _tiny_z_image(tmp_path, modes: str) -> list[str]:
    """The benchmark's arguments for ``modes`` on tiny Z-Image, one timed run, on the CPU."""
    argv = ["--pipeline", "z-image", "--weights", "tiny", "--device", "cpu", "--resolutions", "32x32", "--steps", "2"]
    return argv + ["--modes", modes, "--runs", "1", "--warmup", "0", "--out", str(tmp_path), "--no-progress"]


def test_a_mode_that_fails_to_tear_down_keeps_the_groups_timings(tmp_path, monkeypatch, caplog):
    """Run 202: Wan 2.1 14B with fast-fp8 and fast-fp8-fa4 on an 80 GB GPU timed both, then the first one's
    restore ran out of memory moving its original weights back while the other held its FP8 copy, and the
    exception lost every timing of the group."""

    def failing(name, mode, teardown):
        if name != "bcg":
            return teardown

        def failing_teardown():
            teardown()
            raise torch.OutOfMemoryError("CUDA out of memory (test)")

        return failing_teardown

    _teardowns_wrapped(monkeypatch, failing)
    assert cli.main(_tiny_z_image(tmp_path, "eager,bcg")) == 0
    (case,) = json.loads((tmp_path / "results.json").read_text())["cases"]
    ours = case["modes"]["bcg"]
    assert ours["latency_s"]["median"] > 0 and ours["identical"], ours
    assert ours["teardown_error"] == "OutOfMemoryError: CUDA out of memory (test)", ours
    assert "mode bcg: tearing it down failed" in caplog.text
    assert "teardown failed" in (tmp_path / "results.md").read_text()


def test_each_modes_pipeline_copy_goes_before_the_next_mode_is_torn_down(tmp_path, monkeypatch):
    """Tearing a mode down may move weights back to the GPU (``restore`` dequantizes an FP8 transformer): with a
    restored copy of a 14B transformer still held, the next FP8 mode's teardown ran out of memory (Wan 2.1,
    two FP8 modes, H100, runs 230 and 231). So the group lets each copy go before it tears the next mode down."""
    import weakref

    copies, alive_at_teardown = [], []

    def recording(name, mode, teardown):
        index = len(copies)
        copies.append(weakref.ref(mode.pipe.transformer))

        def recorded_teardown():  # holds no reference to the mode: only its index
            alive_at_teardown.append(sum(ref() is not None for ref in copies[:index]))
            teardown()

        return recorded_teardown

    _teardowns_wrapped(monkeypatch, recording)
    assert cli.main(_tiny_z_image(tmp_path, "eager,bcg,fast")) == 0
    assert alive_at_teardown == [0, 0, 0], alive_at_teardown
