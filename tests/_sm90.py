"""Our Triton kernels compiled for an H100/H200 (sm_90) on a machine without a GPU.

Triton compiles a kernel to PTX and, with the ``ptxas`` its wheel bundles, to a cubin without touching a
driver: only the launch needs one. :func:`launches` runs a kernel module's host code (its ``_launch``) on
CPU tensors with the kernel replaced by a recorder of each launch's arguments, and :func:`compile_sm90`
compiles a recorded launch for compute capability 9.0, so that a CPU test sees what the GPU would run:
that it compiles at all, and which instructions it rounds with.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


class _Recorder:
    """Stands in for a ``@triton.jit`` function: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


@contextlib.contextmanager
def launches(module: Any, name: str) -> Iterator[list[tuple[Any, tuple, dict]]]:
    """Within the block, ``module.<name>`` (a Triton kernel) records its launches instead of running;
    yields the list of ``(kernel, args, kwargs)`` it fills."""
    fn = getattr(module, name)
    recorder = _Recorder(fn)
    recorded: list[tuple[Any, tuple, dict]] = []
    setattr(module, name, recorder)
    try:
        yield recorded
    finally:
        setattr(module, name, fn)
        recorded.extend((fn, args, kwargs) for args, kwargs in recorder.launches)


def compile_sm90(fn: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Compile one recorded launch of ``fn`` for sm_90 (signature from the arguments' types, constexprs
    from their values, launch options such as ``num_warps`` and ``enable_fp_fusion`` from ``kwargs``);
    returns Triton's ``asm`` (``"ptx"``, ``"cubin"``...). Raises what Triton's compiler raises."""
    return compile_kernel_sm90(fn, args, kwargs).asm


def compile_kernel_sm90(fn: Any, args: tuple, kwargs: dict) -> Any:
    """:func:`compile_sm90`, returning Triton's ``CompiledKernel`` (kept in Triton's cache, as a launch
    would keep it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    bound = dict(zip(fn.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    signature, constexprs = {}, {}
    for index, param in enumerate(fn.params):
        value = bound.get(param.name, param.default)
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[(index,)] = value
        else:
            signature[param.name] = mangle_type(value)
    options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
    source = ASTSource(fn, signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas() -> Path | None:
    """The ``ptxas`` Triton's wheel bundles, or None (no Triton, or a build without it)."""
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return path if path.exists() else None


def registers_and_spills(ptx: str) -> tuple[int, int, int]:
    """Assemble ``ptx`` for sm_90a with the bundled ``ptxas -v``; returns (registers per thread, bytes of
    spill stores, bytes of spill loads), as ptxas reports them for the kernel."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder, "kernel.ptx")
        source.write_text(ptx)
        done = subprocess.run(
            [str(ptxas()), "-arch=sm_90a", "-v", str(source), "-o", str(Path(folder, "kernel.cubin"))],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    report = done.stdout + done.stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert registers and spills, report
    return int(registers.group(1)), int(spills.group(1)), int(spills.group(2))
