"""Gradio demo: the reference and the accelerated image of one pipeline side by side, with latencies and graph costs.

    python app.py                                            # tiny random pipelines; CPU unless a GPU is there
    python app.py --pipeline z-image --weights random-full   # full-size random weights (needs an NVIDIA GPU)
    python app.py --pipeline z-image --weights random-full --mode fast   # fast mode selected when the page opens
    python app.py --pipeline z-image --weights Tongyi-MAI/Z-Image-Turbo --port 7861 --share
    python app.py --pipeline z-image --weights random-full --record DIR  # no page: save one generation
    python app.py --replay DIR                                           # the page for that saved generation

The logic lives in ``bcg_diffusion.demo``; this file parses options, lays out the page and wires it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

# Gradio and huggingface_hub read these when imported: the page must not call home, so they are set before
# gradio, diffusers and bcg_diffusion are imported (in main()).
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

PIPELINES = ("z-image", "qwen-image")  # bcg_diffusion.models.PIPELINE_NAMES, z-image first: smaller and faster
RANDOM_WEIGHTS = ("tiny", "random-full")
DTYPES = ("bfloat16", "float16", "float32")
ACCELERATIONS = ("exact", "fast")  # bcg_diffusion.demo.ACCELERATIONS (not imported here: see the environment above)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pipeline",
        nargs="+",
        choices=PIPELINES,
        default=None,
        help="pipelines offered on the page, the first selected (default: both with random weights)",
    )
    parser.add_argument(
        "--weights",
        "--model",
        default="tiny",
        help="'tiny' (small random models, fine on a CPU), 'random-full' (real architectures, random weights: "
        "needs a big GPU) or a checkpoint: hub id or local directory of the one --pipeline (default: tiny)",
    )
    parser.add_argument(
        "--mode",
        choices=ACCELERATIONS,
        default="exact",
        help="acceleration mode selected when the page opens, warmed up at start and recorded by --record; the "
        "page offers every mode. exact: graphs of the eager kernels, byte-identical to eager; fast: the "
        "transformer's blocks compiled inside the graphs, compared with fast mode's reference (its compiled "
        "blocks without graphs) since it rounds differently from eager (default: exact)",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: float32 for tiny, else bfloat16")
    parser.add_argument(
        "--warmup",
        default=None,
        help="resolutions to capture at start, e.g. '512x512,1024x1024', or 'none' "
        "(default: the page's default resolution)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="requests run at once (default 1: concurrent runs on one device distort each other's timings; "
        "requests on one pipeline are serialised anyway)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=7860, help="port (default: 7860)")
    parser.add_argument("--share", action="store_true", help="also open a public Gradio link (needs the internet)")
    parser.add_argument(
        "--verbose", action="store_true", help="log what the library does (captures, compiles) at INFO"
    )
    parser.add_argument(
        "--record",
        metavar="DIR",
        help="no page: generate side by side twice with the one --pipeline's defaults and save the second "
        "(replayed) result to DIR, e.g. on a GPU machine without a browser",
    )
    parser.add_argument(
        "--replay", metavar="DIR", help="serve the page for a result saved with --record (nothing is recomputed)"
    )
    args = parser.parse_args(argv)
    if args.record and args.replay:
        parser.error("--record and --replay exclude each other")
    if args.record and args.pipeline is not None and len(args.pipeline) > 1:
        parser.error("--record takes a single --pipeline")
    if args.pipeline is None:
        if args.weights not in RANDOM_WEIGHTS:
            parser.error(f"--weights {args.weights!r} is a checkpoint: say which pipeline it is with --pipeline")
        args.pipeline = list(PIPELINES)
    if args.weights not in RANDOM_WEIGHTS and len(args.pipeline) > 1:
        parser.error("a checkpoint is for one pipeline: give a single --pipeline")
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    return args


def build_ui(
    backend: Any, warmup_status: Any, default_pipeline: str, banner: str = "", default_acceleration: str = "exact"
) -> Any:
    """The page: settings on the left, the two images and the report on the right, warm-up status on top."""
    import gradio as gr

    from bcg_diffusion import demo

    accelerations = list(getattr(backend, "accelerations", demo.ACCELERATIONS))
    if default_acceleration not in accelerations:
        default_acceleration = accelerations[0]

    def reference_label(name: str) -> str:
        entry = demo.ACCELERATIONS.get(name)
        reference = entry.reference if entry is not None else "reference"
        return reference[:1].upper() + reference[1:]

    defaults = backend.defaults(default_pipeline)
    choices = [demo.format_resolution(size) for size in defaults.resolutions]
    graphs_note = (
        "CUDA graphs"
        if backend.uses_cuda_graphs
        else "not on CUDA: `accelerate(pipe, debug=True)`, speed numbers are **not meaningful**"
    )
    with gr.Blocks(analytics_enabled=False, title="bcg-diffusion demo") as page:
        gr.Markdown(
            "## bcg-diffusion: eager vs breakable CUDA graphs\n"
            f"Weights `{backend.weights}` on `{backend.device}` ({graphs_note}). Both images come from the same "
            "pipeline object and seed; the accelerated one should be byte-identical to the reference: eager in "
            "exact mode, the compiled blocks without graphs in fast mode (which rounds differently from eager)."
            + (f"\n\n{banner}" if banner else "")
        )
        status = gr.Markdown(warmup_status.markdown(), elem_id="warmup-status")
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                prompt_value = getattr(backend, "default_prompt", demo.DEFAULT_PROMPT)
                prompt = gr.Textbox(label="Prompt", value=prompt_value, lines=3, elem_id="prompt")
                negative = gr.Textbox(label="Negative prompt (used with CFG)", value="", elem_id="negative-prompt")
                with gr.Row():
                    pipeline = gr.Radio(
                        list(backend.pipelines), value=default_pipeline, label="Pipeline", elem_id="pipeline"
                    )
                    acceleration = gr.Radio(
                        accelerations,
                        value=default_acceleration,
                        label="Acceleration mode",
                        info="; ".join(
                            f"{name}: {demo.ACCELERATIONS[name].summary}"
                            for name in accelerations
                            if name in demo.ACCELERATIONS
                        ),
                        elem_id="acceleration",
                    )
                resolution = gr.Dropdown(
                    choices,
                    value=demo.format_resolution(defaults.resolution),
                    allow_custom_value=True,
                    label="Resolution (width x height, multiples of 16)",
                    elem_id="resolution",
                )
                steps = gr.Slider(1, demo.MAX_STEPS, value=defaults.steps, step=1, label="Steps", elem_id="steps")
                guidance = gr.Slider(
                    0,
                    demo.MAX_GUIDANCE,
                    value=defaults.guidance,
                    step=0.5,
                    label="Guidance (Qwen-Image: true CFG when > 1; Z-Image: CFG when > 0)",
                    elem_id="guidance",
                )
                seed = gr.Number(value=0, precision=0, minimum=0, label="Seed", elem_id="seed")
                mode = gr.Radio(list(demo.MODES), value=demo.SIDE_BY_SIDE, label="Run", elem_id="mode")
                button = gr.Button("Generate", variant="primary", elem_id="generate")
            with gr.Column(scale=2):
                with gr.Row():
                    eager_image, accelerated_image = (
                        gr.Image(
                            label=label,
                            type="pil",
                            format="png",
                            interactive=False,
                            height=384,
                            buttons=["download", "fullscreen"],
                            elem_id=f"{name}-image",
                        )
                        for name, label in (
                            ("eager", reference_label(default_acceleration)),
                            ("accelerated", "Accelerated"),
                        )
                    )
                report = gr.Markdown("Press **Generate**.", elem_id="report")

        def pipeline_defaults(name: str) -> tuple[Any, Any]:
            chosen = backend.defaults(name)
            return gr.update(value=chosen.steps), gr.update(value=chosen.guidance)

        def acceleration_chosen(name: str) -> Any:
            return gr.update(label=reference_label(name))

        pipeline.change(pipeline_defaults, inputs=pipeline, outputs=[steps, guidance], queue=False)
        acceleration.change(acceleration_chosen, inputs=acceleration, outputs=eager_image, queue=False)
        button.click(
            demo.gradio_handler(backend),
            inputs=[prompt, negative, pipeline, resolution, steps, guidance, seed, mode, acceleration],
            outputs=[eager_image, accelerated_image, report],
            concurrency_id="generate",
        )

        timer = gr.Timer(1.0, active=not warmup_status.finished)

        def refresh_status() -> tuple[str, Any]:
            return warmup_status.markdown(), gr.Timer(active=not warmup_status.finished)

        timer.tick(refresh_status, outputs=[status, timer], queue=False, show_progress="hidden")
    return page


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.weights in RANDOM_WEIGHTS:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights need no hub: never try to reach it
    # The page's own progress at INFO; the library's captures and compiles only with --verbose (they are many).
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("bcg_diffusion.demo").setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Gradio's own start-up probes of the local server

    import torch

    from bcg_diffusion import demo

    if args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"app.py: --device {args.device}, but this torch sees no CUDA GPU", file=sys.stderr)
        return 2
    if args.replay:
        return serve_replay(args)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        backend = demo.DemoBackend(args.weights, args.device, pipelines=args.pipeline, dtype=dtype)
    except (ValueError, RuntimeError) as exc:
        print(f"app.py: {exc}", file=sys.stderr)
        return 2
    if args.weights == "random-full" and not backend.uses_cuda_graphs:
        print(
            "app.py: warning: full-size random models on a CPU take tens of GB and minutes per image", file=sys.stderr
        )

    default_pipeline = args.pipeline[0]
    if args.record:
        from pathlib import Path

        from bcg_diffusion.demo.record import record

        try:
            result = record(backend, default_pipeline, Path(args.record), acceleration=args.mode)
        except demo.DemoError as exc:
            print(f"app.py: --record: {exc}", file=sys.stderr)
            return 1
        print(result.report_markdown())
        print(f"app.py: recorded to {args.record}; show it with: python app.py --replay {args.record}")
        return 0
    defaults = backend.defaults(default_pipeline)
    if args.warmup is None:
        resolutions = [defaults.resolution]
    elif args.warmup.strip().lower() in ("", "none"):
        resolutions = []
    else:
        try:
            resolutions = [demo.parse_resolution(text, defaults.max_side) for text in args.warmup.split(",")]
        except demo.DemoError as exc:
            print(f"app.py: --warmup: {exc}", file=sys.stderr)
            return 2

    if resolutions:
        warmup_status, _ = demo.warm_up_in_background(backend, resolutions, args.pipeline, acceleration=args.mode)
    else:
        warmup_status = demo.WarmupStatus()
    page = build_ui(backend, warmup_status, default_pipeline, default_acceleration=args.mode)
    page.queue(default_concurrency_limit=args.concurrency)
    _launch(page, args)
    return 0


def _launch(page: Any, args: argparse.Namespace) -> None:
    """Serve the page, saying where in our words (Gradio's own start-up text names launch()'s arguments, not
    this script's options)."""
    print(
        f"app.py: serving on http://{args.host}:{args.port}" + ("" if args.share else " (--share for a public link)")
    )
    page.launch(server_name=args.host, server_port=args.port, share=args.share, show_error=False, quiet=not args.share)


def serve_replay(args: argparse.Namespace) -> int:
    """Serve the page for a result saved with ``--record`` (see ``bcg_diffusion.demo.record``)."""
    from bcg_diffusion import demo
    from bcg_diffusion.demo.record import RecordedBackend

    try:
        backend = RecordedBackend(args.replay)
    except (FileNotFoundError, ValueError) as exc:
        print(f"app.py: --replay: {exc}", file=sys.stderr)
        return 2
    env = backend.environment
    banner = (
        f"**Replay of a result recorded on {env.get('gpu') or backend.result.device}** ({env.get('date', '?')}, "
        f"torch {env.get('torch', '?')}, diffusers {env.get('diffusers', '?')}): Generate shows that run's "
        "images and numbers; nothing is recomputed here. The recording is the second call at these settings: "
        "the first one captured the graphs, so this one shows only replays."
    )
    page = build_ui(backend, demo.WarmupStatus(), backend.pipelines[0], banner, backend.accelerations[0])
    page.queue(default_concurrency_limit=args.concurrency)
    _launch(page, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
