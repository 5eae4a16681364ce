"""The KV cache: the FP2 format (spec, quantizer, packing, rotation), baseline codecs, paged caches.

See docs/fp2-format.md for the format and docs/kv-quality.md for its measured quality.
"""
