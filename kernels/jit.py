"""Run-time compilation of `kernels/cuda/*.cu` with NVRTC (cuda.core), cached on disk.

Cache key: sha256 over the source with its local `#include "..."` files inlined, the compile
options (arch, std, defines, flags), NVRTC's version and cuda.core's version. Cubins are written
to a temporary file and renamed into place (atomic), under a file lock so that the ranks of a
node compile each kernel once; an in-process dict sits in front. `ZERODRAM_KEEP_KERNEL_SOURCE=1`
keeps the exact compiled source and the NVRTC log beside each cubin, for inspection.

Kernels are declared `extern "C" __global__` so that cached cubins can be looked up by plain name.
Every `.cu` must compile on its own with the defaults of its `#ifndef` macros (CI compiles them
all for sm_90 on a machine without a GPU).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import tempfile
import threading
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from zerodram.runtime.envs import ENVS
from zerodram.runtime.errors import ZerodramError

SOURCE_DIR = Path(__file__).resolve().parent / "cuda"
DEFAULT_ARCH = "sm_90"
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


class KernelBuildError(ZerodramError):
    """NVRTC rejected a kernel, or the CUDA headers are missing."""


@dataclass(frozen=True)
class BuildOptions:
    """What a kernel is compiled with; part of the cache key."""

    arch: str = DEFAULT_ARCH
    std: str = "c++17"
    defines: tuple[tuple[str, str], ...] = ()
    nvshmem: bool = False  # add NVSHMEM's device headers to the include path
    extra: tuple[str, ...] = ()

    @staticmethod
    def make(arch: str = DEFAULT_ARCH, defines: dict[str, Any] | None = None, **kw: Any) -> BuildOptions:
        items = tuple(sorted((k, str(v)) for k, v in (defines or {}).items()))
        return BuildOptions(arch=arch, defines=items, **kw)


def list_sources() -> list[Path]:
    """Every kernel source shipped in the package."""
    return sorted(SOURCE_DIR.glob("*.cu"))


ARCH_LINE = "// arch: "  # a source's line naming the arch it needs, e.g. "// arch: sm_90a" (wgmma)


def source_arch(path: Path) -> str:
    """The arch a kernel source declares it needs (`ARCH_LINE`), else DEFAULT_ARCH."""
    for line in path.read_text().splitlines():
        if line.startswith(ARCH_LINE):
            return line[len(ARCH_LINE) :].strip()
    return DEFAULT_ARCH


def _inline_includes(path: Path, seen: set[Path] | None = None) -> str:
    """The source with local includes expanded, so the hash covers them (and NVRTC needs no path)."""
    seen = set() if seen is None else seen
    text = path.read_text()

    def expand(m: re.Match[str]) -> str:
        inc = (path.parent / m.group(1)).resolve()
        if not inc.exists():
            return m.group(0)  # a system/toolkit header found through the include path
        if inc in seen:
            return f"// (already included: {m.group(1)})"
        seen.add(inc)
        return f"// begin {m.group(1)}\n{_inline_includes(inc, seen)}\n// end {m.group(1)}"

    return _INCLUDE_RE.sub(expand, text)


@cache
def _header_dirs(nvshmem: bool) -> tuple[str, ...]:
    """Include dirs from the pip packages; /usr/local/cuda must not stand in for a missing one."""
    import cuda.pathfinder as pf

    names = ["cudart", "cccl"] + (["nvshmem"] if nvshmem else [])
    dirs = []
    for name in names:
        try:
            found = pf.locate_nvidia_header_directory(name)
        except Exception as err:  # pathfinder raises its own types
            found, why = None, err
        else:
            why = None
        if found is not None and found.found_via != "site-packages" and ENVS.ALLOW_SYSTEM_CUDA_HEADERS.get():
            dirs.append(found.abs_path)  # opted in: e.g. the GPU image has no pip cccl headers
            continue
        if found is None or found.found_via != "site-packages":
            pkg = {
                "cudart": "cuda-toolkit[cudart]",
                "cccl": "cuda-toolkit[cudart]",
                "nvshmem": "nvidia-nvshmem-cu13",
            }[name]
            where = f" (found only via {found.found_via}: {found.abs_path})" if found else ""
            raise KernelBuildError(
                f"CUDA headers '{name}' not installed from pip{where}{': ' + str(why) if why else ''}; "
                f"install {pkg}"
            )
        dirs.append(found.abs_path)
    return tuple(dirs)


@cache
def compiler_version() -> str:
    import cuda.core
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"nvrtc-{major}.{minor}+cuda.core-{cuda.core.__version__}"


def _cache_key(source: str, opts: BuildOptions) -> str:
    h = hashlib.sha256()
    for part in (source, repr(opts), compiler_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


@dataclass
class _Memo:
    lock: threading.Lock = field(default_factory=threading.Lock)
    cubins: dict[tuple[str, BuildOptions], bytes] = field(default_factory=dict)


_MEMO = _Memo()


def compile_cubin(name: str, opts: BuildOptions | None = None) -> bytes:
    """Compile `kernels/cuda/<name>.cu` to a cubin (or take it from the cache).

    Raises:
        KernelBuildError: with NVRTC's log, if compilation fails.
    """
    opts = opts or BuildOptions()
    memo_key = (name, opts)
    with _MEMO.lock:
        if memo_key in _MEMO.cubins:
            return _MEMO.cubins[memo_key]
    path = SOURCE_DIR / f"{name}.cu"
    if not path.exists():
        raise KernelBuildError(f"no kernel source {path} (have: {[p.stem for p in list_sources()]})")
    source = _inline_includes(path)
    key = _cache_key(source, opts)
    cache_dir = Path(ENVS.CACHE_DIR.get()) / "kernels"
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"{name}-{opts.arch}-{key[:20]}.cubin"
    if not target.exists():
        with open(cache_dir / f"{target.stem}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the ranks of a node wait here for the first
            try:
                if not target.exists():
                    _build(name, source, opts, target)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    cubin = target.read_bytes()
    with _MEMO.lock:
        _MEMO.cubins[memo_key] = cubin
    return cubin


def _build(name: str, source: str, opts: BuildOptions, target: Path) -> None:
    from cuda.core import Program, ProgramOptions

    options = ProgramOptions(
        name=f"{name}.cu",
        arch=opts.arch,
        std=opts.std,
        include_path=list(_header_dirs(opts.nvshmem)),
        define_macro=[(k, v) for k, v in opts.defines] or None,
        **_extra_options(opts.extra),
    )
    try:
        obj = Program(source, "c++", options=options).compile("cubin")
    except Exception as err:
        raise KernelBuildError(f"NVRTC failed on {name}.cu ({opts}):\n{err}") from err
    if ENVS.KEEP_KERNEL_SOURCE.get():
        target.with_suffix(".cu").write_text(source)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(obj.code)
    os.replace(tmp, target)


def _extra_options(extra: tuple[str, ...]) -> dict[str, Any]:
    """Map a few flag spellings onto ProgramOptions fields."""
    out: dict[str, Any] = {}
    for flag in extra:
        if flag == "-lineinfo":
            out["lineinfo"] = True
        elif flag == "--use_fast_math":
            out["use_fast_math"] = True
        elif flag.startswith("-maxrregcount="):
            out["max_register_count"] = int(flag.split("=", 1)[1])
        elif flag.startswith("-Xptxas="):  # one ptxas option, e.g. -Xptxas=--register-usage-level=8
            out.setdefault("ptxas_options", []).append(flag.split("=", 1)[1])
        else:
            raise KernelBuildError(f"unsupported compile flag {flag!r}")
    return out
