"""The environment variables zerodram reads, in one typed registry.

Nothing else in the package calls `os.environ` directly: add a variable here, with its type,
default and meaning, and read it through `ENVS.<name>.get()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from zerodram.runtime.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    kind: type
    default: T | None
    doc: str
    low: float | None = None  # the allowed range of a number, both ends included
    high: float | None = None

    def get(self) -> T | None:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            if self.kind is bool:
                if raw.lower() in ("1", "true", "yes", "on"):
                    return True  # type: ignore[return-value]
                if raw.lower() in ("0", "false", "no", "off"):
                    return False  # type: ignore[return-value]
                raise ValueError(raw)
            value = self.kind(raw)
        except ValueError:
            raise ConfigError(
                f"environment variable {self.name}={raw!r} is not a valid {self.kind.__name__}"
            ) from None
        # written so that nan fails too: every comparison with it is False
        if not ((self.low is None or value >= self.low) and (self.high is None or value <= self.high)):
            allowed = f"in [{self.low:g}, {self.high:g}]" if self.high is not None else f">= {self.low:g}"
            raise ConfigError(f"environment variable {self.name}={raw!r} must be {allowed}")
        return value

    def require(self) -> T:
        value = self.get()
        if value is None:
            raise ConfigError(f"environment variable {self.name} is not set ({self.doc})")
        return value


# Timeouts in seconds. Above a millisecond: zero or less would fail every wait at once. At most
# 1e9 s: long enough to hold a rank in a debugger for days, while the device kernels take the
# bound as a uint64 of nanoseconds, which 1.8e10 s would overflow.
TIMEOUT_RANGE_S = (0.001, 1e9)


def _default_cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "zerodram" if xdg else Path.home() / ".cache" / "zerodram"


class _Registry:
    # --- set by torchrun (or by tests/multirank.py, which mimics it) ---
    RANK = EnvVar("RANK", int, None, "global rank, set by torchrun", low=0)
    LOCAL_RANK = EnvVar("LOCAL_RANK", int, None, "rank within the node, set by torchrun", low=0)
    WORLD_SIZE = EnvVar("WORLD_SIZE", int, None, "number of ranks, set by torchrun", low=1)
    LOCAL_WORLD_SIZE = EnvVar("LOCAL_WORLD_SIZE", int, None, "ranks on this node, set by torchrun", low=1)
    GROUP_RANK = EnvVar("GROUP_RANK", int, None, "node index, set by torchrun", low=0)
    MASTER_ADDR = EnvVar("MASTER_ADDR", str, None, "rendezvous host, set by torchrun")
    MASTER_PORT = EnvVar("MASTER_PORT", int, None, "rendezvous port, set by torchrun", low=1, high=65535)
    # --- zerodram's own ---
    TOPOLOGY = EnvVar(
        "ZERODRAM_TOPOLOGY", str, None, "topology file a worker loads (set by `zerodram launch`)"
    )
    CACHE_DIR = EnvVar("ZERODRAM_CACHE_DIR", Path, _default_cache_dir(), "kernel cache folder")
    KEEP_KERNEL_SOURCE = EnvVar(
        "ZERODRAM_KEEP_KERNEL_SOURCE",
        bool,
        False,
        "write the preprocessed source and PTX next to each cached cubin, for inspection",
    )
    WAIT_TIMEOUT_S = EnvVar(
        "ZERODRAM_WAIT_TIMEOUT_S",
        float,
        60.0,
        "bound on every cross-rank wait, host or device",
        *TIMEOUT_RANGE_S,
    )
    ALLOW_SYSTEM_CUDA_HEADERS = EnvVar(
        "ZERODRAM_ALLOW_SYSTEM_CUDA_HEADERS",
        bool,
        False,
        "let the kernel JIT take CUDA headers from CUDA_HOME or /usr/local/cuda when a pip "
        "header package is missing (off by default: a system toolkit can hide a missing dependency)",
    )
    FORCE_CPU = EnvVar("ZERODRAM_FORCE_CPU", bool, False, "ignore GPUs even when present")
    # --- expert parallelism (runtime/moe, runtime/comm) ---
    EP_BACKEND = EnvVar(
        "ZERODRAM_EP_BACKEND", str, "auto", "dispatch/combine backend: auto, torch (host-driven) or nvshmem"
    )
    EP_DEVICE_TIMEOUT_S = EnvVar(
        "ZERODRAM_EP_DEVICE_TIMEOUT_S",
        float,
        None,
        "bound on the device-side spin-waits of dispatch/combine (default: ZERODRAM_WAIT_TIMEOUT_S)",
        *TIMEOUT_RANGE_S,
    )
    # --- end expert parallelism ---


ENVS = _Registry()
