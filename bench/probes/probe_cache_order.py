"""Where an accelerated cached call first differs from eager with the same cache, when the cache is
enabled after ``accelerate`` (tiny pipelines, GPU). Prints, per variant, the index of the first
transformer call whose output differs and that call's cache context."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests")
from _caches import cache_config  # noqa: E402
from _cases import cuda_pipeline, run_case  # noqa: E402

from bcg_diffusion import accelerate, restore, stats  # noqa: E402
from bcg_diffusion.core.tree import flatten  # noqa: E402
from bcg_diffusion.features.step_caching import disable_cache, enable_cache  # noqa: E402

DEBUG = "--cpu" in sys.argv
if DEBUG:
    import contextlib

    from bcg_diffusion.models import build_pipeline

    @contextlib.contextmanager
    def cuda_pipeline(name, weights):  # noqa: F811 - the CPU stand-in, to check this script
        pipe = build_pipeline(name, weights)
        pipe.set_progress_bar_config(disable=True)
        yield pipe


CASE = {"qwen-image": "true_cfg", "z-image": "cfg"}


def outputs(pipe, name):
    seen = []
    handle = pipe.transformer.register_forward_hook(
        lambda m, a, o: seen.append([t.detach().clone() for t in flatten(o)[0]])
    )
    image = run_case(pipe, name, CASE[name], height=64, width=64, steps=6)
    handle.remove()
    return image, seen


for name in ("qwen-image", "z-image"):
    for cache in ("taylorseer", "magcache", "first-block"):
        for plain_first in (True, False):
            with cuda_pipeline(name, "tiny") as pipe:
                enable_cache(pipe, cache_config(cache, 6, 1.5))
                ref, ref_out = outputs(pipe, name)
                disable_cache(pipe)
                accelerate(pipe, debug=DEBUG)
                if plain_first:
                    run_case(pipe, name, CASE[name], height=64, width=64, steps=6)
                enable_cache(pipe, cache_config(cache, 6, 1.5))
                image, out = outputs(pipe, name)
                first = next(
                    (i for i, (a, b) in enumerate(zip(ref_out, out)) if not all(map(torch.equal, a, b))), None
                )
                s = stats(pipe)
                print(
                    f"{name} {cache} plain_first={plain_first}: equal={torch.equal(ref, image)} first_diff={first} "
                    f"of {len(out)} captures={s['captures']} fallbacks={s['eager_fallbacks']}",
                    flush=True,
                )
                restore(pipe)
