"""Benchmark output: a Markdown table, a JSON record and a PNG plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .modes import OURS


def _fmt_s(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _mib(value: int | None) -> str:
    return "–" if not value else f"{value / 2**20:.0f}"


def _stages_note(record: dict[str, Any]) -> str:
    """How the stage times of ``record`` were measured (``bench.measure.timed_call``)."""
    if record["environment"].get("device", "").startswith("cpu"):
        return "host time (a CPU run)."
    if record.get("stage_syncs"):
        return "host time between synchronisations at each boundary (--stage-syncs)."
    return "GPU time between CUDA events at each boundary; nothing inside a timed call waits for the GPU."


def markdown(record: dict[str, Any]) -> str:
    """One table per case: a row per mode, plus a plain sentence on who is fastest."""
    out = [f"`{record['command']}`", "", "Environment: " + json.dumps(record["environment"]), ""]
    if record["environment"].get("device", "").startswith("cpu"):
        out += ["**CPU run: timings are not meaningful (bcg runs in debug mode, without graphs).**", ""]
    out += [
        "Same as eager: every timed run byte-equal to eager's first (untimed) call with the same inputs and "
        "seed; eager's own row compares its timed runs with that call.",
        "",
        "Stages: " + _stages_note(record),
        "",
    ]
    for case in record["cases"]:
        out += [f"### {case['label']}", ""]
        out.append(
            "| mode | median (s) | min / max (s) | speed-up vs eager | first call (s) | encode / denoise / decode (s) "
            "| peak mem (MiB) | graph mem (MiB) | captures / replays | same as eager (+cache: as eager+cache) |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for name, mode in case["modes"].items():
            if mode.get("error"):
                out.append(f"| {name} | failed: {mode['error'][:120]} |||||||||")
                continue
            latency = mode["latency_s"]
            stages = mode["stages_s"]
            graphs = mode.get("graphs") or {}
            same = _same_as_eager(mode)
            if "identical_to_reference" in mode:
                same += f"; same as {mode['reference']}: {'yes' if mode['identical_to_reference'] else '**no**'}"
            speedup = mode.get("speedup")
            if mode.get("baseline", "eager") != "eager":
                same = same.replace("yes (md5)", f"yes, as {mode['baseline']} (md5)")
            if mode.get("psnr_vs_eager_db") is not None:
                same += f"; against eager PSNR {mode['psnr_vs_eager_db']:.1f} dB, max {mode['max_abs_vs_eager']:.3g}"
            if mode.get("cache_skipped"):
                skipped = mode["cache_skipped"]
                versus = mode.get("speedup_vs_eager_cache")
                same += f"; cache skipped {skipped['skipped']}/{skipped['calls']} calls"
                if versus is not None and name != "eager+cache":
                    same += f", {versus:.2f}× vs eager+cache"
            out.append(
                f"| {name} | {latency['median']:.3f} | {latency['min']:.3f} / {latency['max']:.3f} | "
                f"{'–' if speedup is None else f'**{speedup:.2f}×**'} | {mode['first_call_s']:.2f} | "
                f"{stages['encode']:.3f} / {stages['denoise']:.3f} / {stages['decode']:.3f} | "
                f"{_mib(mode['peak_memory_bytes'])} | {_mib(graphs.get('graph_memory_bytes'))} | "
                f"{graphs.get('captures', '–')} / {graphs.get('replays', '–')} | {same} |"
            )
        steps = [f"{n} {m['denoise_per_step_s']:.3f} s" for n, m in case["modes"].items() if "denoise_per_step_s" in m]
        if steps:
            out += ["", "Denoising per step (the denoise stage's median over its steps): " + ", ".join(steps) + "."]
        checks = [
            f"{n} {m['state_check_s_per_call'] * 1e3:.3f} ms ({m['state_check_share']:.2%} of a call)"
            for n, m in case["modes"].items()
            if m.get("state_check_s_per_call") is not None
        ]
        if checks:
            out += ["", "Checking the Python state the graphs read, per timed call: " + ", ".join(checks) + "."]
        per_call = [
            f"{n} {m['graphs']['transformer_captures_per_call']:.2f}"
            for n, m in case["modes"].items()
            if m.get("cache") and (m.get("graphs") or {}).get("transformer_captures_per_call") is not None
        ]
        if per_call:
            out += [
                "",
                "Transformer graphs captured per pipeline call (cached modes, all calls): "
                + ", ".join(per_call)
                + ".",
            ]
        batched = [
            f"{n} {m['graphs']['cfg_batched']} ({m['graphs'].get('cfg_batch_dropped', 0)} dropped)"
            for n, m in case["modes"].items()
            if "cfg_batched" in (m.get("graphs") or {})
        ]
        if batched:
            out += ["", "Uncond calls served from a CFG batch (fast modes, all calls): " + ", ".join(batched) + "."]
        separate = [n for n, m in case["modes"].items() if m.get("eager_same_group_s")]
        torn = [f"{n} ({m['teardown_error'][:160]})" for n, m in case["modes"].items() if m.get("teardown_error")]
        if torn:
            out += ["", "After timing, teardown failed for " + ", ".join(torn) + "; the timings above stand."]
        if separate and case.get("modes_apart"):
            out += [
                "",
                "Each mode ran in a group of its own beside a fresh eager, the groups one after another, each freed "
                "before the next (--modes-apart); its speed-up is over that eager: "
                + ", ".join(f"{n} {case['modes'][n]['eager_same_group_s']['median']:.3f} s" for n in separate)
                + ".",
            ]
        elif separate:
            out += [
                "",
                f"{', '.join(separate)} ran after the other modes were freed, interleaved with a fresh eager "
                "(its speed-up is over that eager: "
                + ", ".join(f"{case['modes'][n]['eager_same_group_s']['median']:.3f} s" for n in separate)
                + "); peers with CUDA graphs of their own do not share a process with live graphs of ours.",
            ]
        cpu = record["environment"].get("device", "").startswith("cpu")
        out += [
            "",
            "No mode is named fastest: a CPU run's timings say nothing of a GPU's." if cpu else verdict(case),
            "",
        ]
        profiles = {n: m["denoise_profile"] for n, m in case["modes"].items() if m.get("denoise_profile")}
        if profiles:
            parts = [
                f"{n} {p['wall_over_kernel']:.3f} (per step {p['step_wall_over_kernel']:.3f})"
                for n, p in profiles.items()
            ]
            out += ["Denoising loop, wall time / GPU kernel time: " + ", ".join(parts), ""]
            shares = [
                f"{n} " + ", ".join(f"{kind} {share:.0%}" for kind, share in p["kernel_share"].items())
                for n, p in profiles.items()
                if p.get("kernel_share")
            ]
            if shares:
                out += ["GPU kernel time by kind: " + "; ".join(shares), ""]
    return "\n".join(out)


def _same_as_eager(mode: dict[str, Any]) -> str:
    """The "same as eager" cell: yes, no (how many timed runs differ, the worst PSNR and difference),
    or not compared."""
    if mode.get("identical") is None:
        return "not compared (no eager reference)"
    if mode["identical"]:
        return "yes (md5)"
    runs = mode.get("runs_identical") or []
    differ = f"{sum(not same for same in runs)} of {len(runs)} runs differ, " if runs else ""
    return f"no: {differ}PSNR {mode['psnr_db']:.1f} dB, max {mode['max_abs']:.3g}"


def verdict(case: dict[str, Any]) -> str:
    """Say plainly which mode is fastest, and by how much a peer beats bcg where one does."""
    timed = {n: m["latency_s"]["median"] for n, m in case["modes"].items() if not m.get("error")}
    if not timed:
        return "No mode completed."
    fastest = min(timed, key=timed.get)
    text = f"Fastest: **{fastest}** ({timed[fastest]:.3f} s)."
    for ours in OURS:
        if ours in timed and fastest != ours:
            margin = (timed[ours] / timed[fastest] - 1) * 100
            text += f" {fastest} beats {ours} by {margin:.0f}%."
    return text


def plot(record: dict[str, Any], path: Path) -> None:
    """Latency per mode and case (bars) and speed-up over eager (second panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = record["cases"]
    modes = list(dict.fromkeys(name for case in cases for name in case["modes"]))
    fig, (ax_latency, ax_speedup) = plt.subplots(2, 1, figsize=(max(6, 2.2 * len(cases) + 3), 7), sharex=True)
    width = 0.8 / max(1, len(modes))
    for index, name in enumerate(modes):
        xs, latencies, speedups = [], [], []
        for position, case in enumerate(cases):
            mode = case["modes"].get(name)
            if not mode or mode.get("error"):
                continue
            xs.append(position + (index - (len(modes) - 1) / 2) * width)
            latencies.append(mode["latency_s"]["median"])
            speedups.append(mode.get("speedup") or math.nan)
        bars = ax_latency.bar(xs, latencies, width, label=name)
        ax_latency.bar_label(bars, fmt="%.3g", fontsize=7)
        bars = ax_speedup.bar(xs, speedups, width, label=name)
        ax_speedup.bar_label(bars, fmt="%.2f×", fontsize=7)
    ax_latency.set_ylabel("end-to-end latency, median (s)")
    ax_latency.legend(fontsize=8)
    ax_speedup.set_ylabel("speed-up over eager")
    ax_speedup.axhline(1.0, color="grey", linewidth=0.8)
    ax_speedup.set_xticks(range(len(cases)))
    ax_speedup.set_xticklabels([c["label"].replace(", ", "\n", 1) for c in cases], fontsize=7)
    title = record["environment"].get("gpu") or "CPU (timings not meaningful)"
    fig.suptitle(f"bcg-diffusion benchmark — {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(record: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` and ``results.png`` under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "md": out_dir / "results.md", "png": out_dir / "results.png"}
    paths["json"].write_text(json.dumps(record, indent=2, default=str))
    paths["md"].write_text(markdown(record) + "\n")
    plot(record, paths["png"])
    return paths
