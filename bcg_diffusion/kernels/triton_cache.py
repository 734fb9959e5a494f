"""Our Triton kernels' compiled binaries, kept with fast mode's portable compile cache.

PyTorch's portable compile artifacts (``torch.compiler.save_cache_artifacts``) hold what inductor
compiled, not the kernels a library launches through Triton's own JIT, as ours are: a process that starts
from the portable file alone builds ours again (Z-Image's portable start took 19.2 s in H200 run 141,
12.7 s in run 134, before the block glue's kernels). Triton keeps each kernel it compiled in a folder of
its cache (``TRITON_CACHE_DIR``, by default ``~/.triton/cache``) named after a hash of the source, the
argument types, the launch options, the GPU target and Triton's version; a process that computes the
same hash loads that folder instead of compiling. So :func:`save` writes the folders of the kernels of
ours this process compiled into one zip file (with the kernels an earlier file held, so a process that
ran fewer shapes drops none), and :func:`load` unpacks such a file into this process's Triton cache, never
over a folder the cache has (another process may be writing it). Another machine with the same GPU
architecture and Triton version then finds them; any other computes other hashes and compiles as before.
Nothing here changes what a kernel computes.

A kernel also needs C modules that Triton builds with the machine's C compiler on its first launch: a
launcher per launch signature (``__triton_launcher``) and the driver's utilities (``cuda_utils``), each
cached in a folder named after the SHA-256 of its C source and the platform. :func:`save` keeps those of
our kernels too, found by the keys Triton computes for them; a machine of the same platform and Python
loads them instead of compiling (anywhere else Triton builds them, as without the file: it checks the
file name, which holds the Python version, and rebuilds a module it cannot load). The file holds compiled
code: load only files you made.

>>> save("cache/bcg-triton-kernels.zip")  # doctest: +SKIP
9
>>> load("cache/bcg-triton-kernels.zip")  # in a new process, before the first launch  # doctest: +SKIP
9

Both do nothing (0) without Triton, or where Triton's cache is not its file cache (a
``TRITON_CACHE_MANAGER`` of the user's).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import types
import warnings
import zipfile
from pathlib import Path

__all__ = ["compiled_count", "load", "save"]

logger = logging.getLogger(__name__)

# Triton names a kernel's folder by the base32 form of its hash, a C module's by the hex SHA-256 of its
# source and platform; the files in them by the kernel's or the module's name.
_FOLDER = re.compile(r"^(?:[A-Z2-7]+|[0-9a-f]{64})$")
_FILE = re.compile(r"^[\w.-]+$")
_GROUP_PREFIX = "__grp__"


@functools.cache
def _module_names() -> tuple[str, ...]:
    """The modules of our kernels: ``bcg_diffusion.kernels._*_triton``."""
    return tuple(f"{__package__}.{path.stem}" for path in sorted(Path(__file__).parent.glob("_*_triton.py")))


@functools.cache
def _jit_functions(module: types.ModuleType) -> tuple[object, ...]:
    from triton.runtime.jit import JITFunction

    return tuple(fn for fn in vars(module).values() if isinstance(fn, JITFunction))


def _launched_kernels() -> list[object]:
    """The kernels (Triton's ``CompiledKernel``) our JIT functions compiled in this process, on every
    device. A few dictionary lookups: it runs after every accelerated call where a compile cache
    directory is set."""
    kernels = []
    for name in _module_names():
        module = sys.modules.get(name)  # not imported: none of its kernels ran
        if module is None:
            continue
        for fn in _jit_functions(module):
            for device_cache in getattr(fn, "device_caches", {}).values():
                # (kernel cache, ...): compiled kernels, or futures of ones still compiling (skipped)
                kernels += [k for k in device_cache[0].values() if getattr(k, "hash", None) is not None]
    return kernels


def compiled_count() -> int:
    """How many kernels of ours this process has compiled (or loaded from Triton's cache): a cheap
    check of whether :func:`save` has something new to write."""
    return len(_launched_kernels())


def _cache_root() -> Path | None:
    """Triton's file cache folder, or None where Triton is missing or its cache is not files."""
    try:
        import triton.knobs as knobs
        from triton.runtime.cache import FileCacheManager
    except ImportError:
        return None
    manager = knobs.cache.manager_class
    if manager is not None and not issubclass(manager, FileCacheManager):
        return None
    return Path(knobs.cache.dir)


def _folder(kernel: object) -> Path | None:
    """The cache folder ``kernel`` was compiled into or loaded from: where its own files are. Not the folder
    its hash names in the cache Triton uses now, which another ``TRITON_CACHE_DIR`` since (inductor sets one
    at its first kernel) would make an empty folder of the new cache. None without files."""
    paths = getattr(kernel, "metadata_group", None) or {}
    return Path(next(iter(paths.values()))).parent if paths else None


def _launcher_source(driver: types.ModuleType, kernel: object) -> str:
    """The C source of ``kernel``'s launcher, as Triton's NVIDIA driver writes it when the kernel is first
    launched (``CudaLauncher``): its constants keyed by argument position, its signature, its tensor
    descriptors."""
    source = kernel.src
    constants = getattr(source, "constants", {})
    constants = {
        ((source.fn.arg_names.index(name),) if isinstance(name, str) else name): value
        for name, value in constants.items()
    }
    return driver.make_launcher(constants, dict(source.signature), getattr(kernel.metadata, "tensordesc_meta", None))


def _module_folders(kernels: list[object], roots: set[Path | None]) -> set[Path]:
    """The cache folders, in any of ``roots``, of the C modules Triton builds to launch ``kernels`` on
    NVIDIA GPUs: each kernel's launcher (Triton up to 3.6; 3.8 has one generic launcher) and the driver's
    ``cuda_utils``, named as Triton names them (the
    SHA-256 of the source and the platform). None where a module was not built, or where this Triton
    writes them otherwise (said at INFO: the kernels are kept, their launchers are built again)."""
    try:
        from triton.backends.nvidia import driver
        from triton.runtime.build import platform_key
    except ImportError:
        return set()
    sources = set()
    try:
        sources.add((Path(driver.__file__).parent / "driver.c").read_text())
        if hasattr(driver, "make_launcher"):  # Triton 3.8 launches every kernel through cuda_utils: none per kernel
            sources |= {_launcher_source(driver, kernel) for kernel in kernels}
    except (OSError, AttributeError, KeyError, TypeError, ValueError) as exc:
        logger.info("Triton's launchers are not kept with the kernels (%s: %s)", type(exc).__name__, exc)
    keys = {hashlib.sha256((source + platform_key()).encode("utf-8")).hexdigest() for source in sources}
    return {root / key for root in roots if root is not None for key in keys if (root / key).is_dir()}


def _kept_files(folder: Path) -> list[Path]:
    """The files of a kernel's cache folder worth keeping: not Triton's temporary files or lock."""
    return [
        path
        for path in sorted(folder.iterdir())
        if path.is_file() and _FILE.match(path.name) and ".tmp." not in path.name and path.name != "lock"
    ]


def save(file: str | os.PathLike[str]) -> int:
    """Write the cache folders of the kernels of ours this process compiled into the zip ``file``, with the
    folders an earlier ``file`` held that this process did not compile (a process that ran fewer shapes
    keeps the others' kernels), and the folders of the C modules Triton built to launch them. Atomic: a
    reader sees the old file or the new one. Returns how many folders (kernels and modules) the file
    holds; with no kernel of this process's (no Triton, nothing compiled, a cache of another kind), writes
    nothing and returns 0."""
    kernels = _launched_kernels()  # first: without a kernel launched, Triton is not even imported
    if not kernels or _cache_root() is None:
        return 0
    folders = {folder for folder in map(_folder, kernels) if folder is not None and folder.is_dir()}
    if not folders:
        return 0
    folders = sorted(folders | _module_folders(kernels, {_cache_root(), *(folder.parent for folder in folders)}))
    file = Path(file)
    earlier = _earlier_members(file, {folder.name for folder in folders})
    partial = file.with_suffix(file.suffix + f".{os.getpid()}.tmp")
    try:
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for folder in folders:
                for path in _kept_files(folder):
                    archive.write(path, f"{folder.name}/{path.name}")
            for name, data in earlier:
                archive.writestr(name, data)
        partial.replace(file)
    finally:
        partial.unlink(missing_ok=True)
    count = len(folders) + len({name.partition("/")[0] for name, _ in earlier})
    logger.info(
        "saved %d Triton cache folders of bcg_diffusion to %s (%d from this process)", count, file, len(folders)
    )
    return count


def _earlier_members(file: Path, written: set[str]) -> list[tuple[str, bytes]]:
    """The entries of an earlier ``file`` whose folders are not in ``written``; none where there is no such
    file or it cannot be read (said at INFO: :func:`save` then replaces it)."""
    if not file.is_file():
        return []
    try:
        with zipfile.ZipFile(file) as archive:
            members = _members(archive)
            return [
                (f"{folder}/{name}", archive.read(f"{folder}/{name}"))
                for folder, names in members.items()
                if folder not in written
                for name in names
            ]
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        logger.info("replacing the unreadable Triton kernels file %s (%s: %s)", file, type(exc).__name__, exc)
        return []


def load(file: str | os.PathLike[str]) -> int:
    """Unpack a zip :func:`save` wrote into this process's Triton cache, so that a launch of the same kernel
    (same source, argument types, options, GPU and Triton) loads it instead of compiling. Folders the cache
    holds already are left as they are. Returns how many folders it added; 0 where there is no file, no
    Triton, or a cache of another kind. A file it cannot read is reported with a warning and ignored (the
    kernels then compile, as without it)."""
    file = Path(file)
    if not file.is_file():
        return 0
    root = _cache_root()  # imports Triton (about a second), so only with a file to unpack
    if root is None:
        return 0
    try:
        with zipfile.ZipFile(file) as archive:
            members = _members(archive)
            added = 0
            for folder, names in members.items():
                # A folder there already is this cache's own: complete, or being written by a process that
                # compiles the kernel now. Never replaced (Triton compiles what it lacks).
                if not (root / folder).exists():
                    added += _unpack(archive, folder, names, root)
    except (OSError, ValueError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
        warnings.warn(f"bcg-diffusion: ignoring Triton kernels file {file}: {type(exc).__name__}: {exc}", stacklevel=2)
        return 0
    logger.info("loaded %d Triton kernels of bcg_diffusion from %s into %s", added, file, root)
    return added


def _members(archive: zipfile.ZipFile) -> dict[str, list[str]]:
    """The archive's files by folder; raises ValueError on a name that is not ``<folder>/<file>`` as
    :func:`save` writes them (nothing is unpacked outside Triton's cache)."""
    members: dict[str, list[str]] = {}
    for name in archive.namelist():
        folder, _, base = name.partition("/")
        if not (_FOLDER.match(folder) and _FILE.match(base)) or base in (".", ".."):
            raise ValueError(f"unexpected entry {name!r}")
        members.setdefault(folder, []).append(base)
    return members


def _unpack(archive: zipfile.ZipFile, folder: str, names: list[str], root: Path) -> int:
    """Unpack one kernel's folder into ``root``, its group files pointing at the new place (Triton's group
    files list their members by absolute path), then move it in place whole. Returns 1, or 0 where another
    process put the folder there first (said at INFO; theirs is kept)."""
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder}.", dir=root))
    target = root / folder
    try:
        for name in names:
            data = archive.read(f"{folder}/{name}")
            if name.startswith(_GROUP_PREFIX):
                group = json.loads(data)
                group["child_paths"] = {
                    child: str(target / Path(path).name) for child, path in group["child_paths"].items()
                }
                data = json.dumps(group).encode()
            (staging / name).write_bytes(data)
        try:
            staging.rename(target)  # refused where the folder appeared meanwhile
        except OSError as exc:
            if not target.exists():
                raise
            logger.info("Triton kernel folder %s appeared while unpacking (%s); kept as it is", target, exc)
            return 0
        return 1
    finally:
        shutil.rmtree(staging, ignore_errors=True)
