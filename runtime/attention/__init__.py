"""FP2 decode attention over a paged FP2 KV cache: the fused CUDA kernels on a GPU, plain torch on CPU.

Shape legend: B seqs, Hq query heads, Hkv kv heads, G = Hq / Hkv, D head dim, NP pages, P page
size, NBK / NBV = D / k_block, D / v_block scale blocks per token, HP bf16 tokens per sequence,
S split slots, N written tokens.

Everything is in the cache's stored space (docs/fp2-format.md): keys and values rotated by their
Hadamard matrix and divided by their per-channel anchor. `prepare_query` folds the key rotation
and anchor into q, `finish_output` applies the value anchor and rotates back; both are one
[D, D] product outside the kernels. A sequence's keys are FP2 tokens [0, fp2_len) reached through
its block-table row (token f in page row[f // P], slot f % P) plus HP bf16 tokens (sinks and the
not yet quantized tail) in `hp_k` / `hp_v`, order-free (attention is a sum over tokens).

The backend (CUDA kernels or the torch reference) is chosen once, at construction, from the
device. Inputs are validated at the boundary: dtypes, shapes, contiguity and device on every call
(host-only checks); page ids against the pool in `check_tables` (it synchronises, so call it where
a sync is harmless, not inside a CUDA-graph capture).

The package's parts: `inputs` (Fp2Layer, DecodeBatch and their builders), `reference` (the
plain-torch definition and the products around it), `decode` (Fp2DecodeAttention), `split_table`
(the split counts measured per GPU model that its plan takes), `writer` (Fp2Writer). Import from
here.
"""

from zerodram.runtime.attention.decode import Fp2DecodeAttention
from zerodram.runtime.attention.inputs import (
    DecodeBatch,
    Fp2Layer,
    batch_from_cache,
    layer_from_cache,
    random_decode_batch,
    random_fp2_layer,
)
from zerodram.runtime.attention.reference import (
    LOG2E,
    VALUE_PRODUCTS,
    dequantize_pages,
    finish_output,
    int8_key_levels,
    prepare_query,
    reference_decode,
)
from zerodram.runtime.attention.split_table import SplitTable, find_table
from zerodram.runtime.attention.writer import Fp2Writer

__all__ = [
    "LOG2E",
    "VALUE_PRODUCTS",
    "DecodeBatch",
    "Fp2DecodeAttention",
    "Fp2Layer",
    "Fp2Writer",
    "SplitTable",
    "batch_from_cache",
    "dequantize_pages",
    "find_table",
    "finish_output",
    "int8_key_levels",
    "layer_from_cache",
    "prepare_query",
    "random_decode_batch",
    "random_fp2_layer",
    "reference_decode",
]
