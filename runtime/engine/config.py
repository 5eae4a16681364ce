"""What an engine is configured with (`EngineConfig`) and what one of its steps reports (`StepStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from zerodram.runtime.attention.reference import VALUE_PRODUCTS
from zerodram.runtime.engine.calibration import CALIB_TOKENS
from zerodram.runtime.engine.scheduler import SchedulerConfig
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.format import DEFAULT_PAGE_SIZE


@dataclass(frozen=True)
class EngineConfig:
    """kv_format: "fp2[:options]", "fp8", "bf16", "fp16" or "fp32"; num_kv_pages x page_size tokens
    per rank. cuda_graphs: capture the decode step on GPU (ignored on CPU; see docs/engine.md):
    True captures or raises; "auto" captures where graphs serve (no MoE layer whose experts a
    graph would run dense; across ranks, NVSHMEM expert parallelism) and otherwise decodes eagerly;
    a failed capture falls back to eager on one rank and raises across ranks (capture is collective).
    fused_decode: FP2 decode rows run the fused decode attention when the kernels read the format
    (False: read the pages back and run SDPA, the reference path).
    kv_calibration: "auto" (compute the FP2 constants at construction when the format needs them),
    "none", or a file saved earlier; kv_calibration_tokens: prefill length of "auto";
    kv_calibration_save: write the constants there (runtime/engine/calibration.py).
    decode_value_product: how the fused FP2 decode's weights meet the values: "exact", or "e4m3",
    a CPU emulation of an FP8 value product for kernel design (benchmarks/engine_kv_ppl.py).
    defer_write: whether a GPU whole-step graph makes each layer's KV write after its decode, on a
    low-priority stream beside the rest of the step, the decode attending the new tokens from the
    step's tensors and the tails as they were (docs/fp2-kernel.md, "Codes at arrival"; a token's
    codes are read a window after it arrives): True (or ConfigError where the kernels or the
    format cannot: no window, say), False (the write as a launch of its own before the decode), or
    "auto" (deferred wherever possible), the default. Ignored on CPU and without CUDA graphs."""

    kv_format: str = "bf16"
    num_kv_pages: int = 512
    page_size: int = DEFAULT_PAGE_SIZE
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int | None = None
    cuda_graphs: bool | str = False
    fused_decode: bool = True
    kv_calibration: str = "auto"
    kv_calibration_tokens: int = CALIB_TOKENS
    kv_calibration_save: str | None = None
    decode_value_product: str = "exact"
    defer_write: bool | str = "auto"

    def __post_init__(self) -> None:
        if self.num_kv_pages < 1 or self.page_size < 1:
            raise ConfigError(
                f"num_kv_pages and page_size must be >= 1, got {self.num_kv_pages}, {self.page_size}"
            )
        if self.kv_calibration_tokens < 1 or not self.kv_calibration:
            raise ConfigError(
                f"kv_calibration must be auto, none or a path and kv_calibration_tokens >= 1, got "
                f"{self.kv_calibration!r}, {self.kv_calibration_tokens}"
            )
        if self.defer_write not in (True, False, "auto"):
            raise ConfigError(f"defer_write must be True, False or 'auto', got {self.defer_write!r}")
        if self.decode_value_product not in VALUE_PRODUCTS:
            raise ConfigError(
                f"decode_value_product must be one of {VALUE_PRODUCTS}, got {self.decode_value_product!r}"
            )


@dataclass(frozen=True)
class StepStats:
    """What one step did on this rank (the metrics module publishes these)."""

    step_idx: int
    num_decode: int
    num_prefill_tokens: int
    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    num_sampled: int
    kv_stored_bytes: int
    kv_bf16_bytes: int
    seconds: float
