"""Teacher-forced scoring through an engine's own model, attention and KV partition.

Shape legend: T tokens of the text, C tokens of one chunk, V vocab.

What a KV format costs the served model, measured without the quality harness (runtime/kv_eval,
which runs transformers with fake quantization): the text is prefilled in chunks of C tokens on the
engine's partition, with logits for every row. A chunk attends to its own tokens in full precision
and to the earlier ones as the partition stores them (FP2 pages, bf16 sinks and window), so
`chunk=1` attends to what decode sees and a larger chunk sees up to C - 1 more full-precision keys
(a slightly optimistic, much cheaper reading); `decode_from` runs the tokens from there on as decode
rows, the serving path itself. One process only (an engine of one rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zerodram.runtime.errors import ConfigError, ZerodramError
from zerodram.runtime.model.batch import ForwardBatch, PrefillSegment


@dataclass(frozen=True)
class TokenScores:
    """logprobs: [T - 1] log p(token t+1 | tokens <= t), fp32 CPU; argmax: [T - 1] the greedy next
    token after t, int64 CPU; logits: [T - 1, V] when kept."""

    logprobs: torch.Tensor
    argmax: torch.Tensor
    logits: torch.Tensor | None = None

    @property
    def ppl(self) -> float:
        return math.exp(-float(self.logprobs.mean()))


def pydoc_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of the pydoc help texts (the harness's text, from its start;
    the engine calibrates on its end).

    Raises:
        ConfigError: the text is too short.
    """
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n".join(topics.values())[: num_tokens * 8])
    if len(ids) < num_tokens:
        raise ConfigError(f"pydoc text holds {len(ids)} tokens here, {num_tokens} requested")
    return ids[:num_tokens]


@torch.inference_mode()
def score_tokens(
    engine, ids: list[int], *, chunk: int = 16, keep_logits: bool = False, decode_from: int | None = None
) -> TokenScores:
    """Teacher-forced log-probabilities of `ids` on `engine` (see the module docstring).

    decode_from: the tokens before it are prefilled in chunks, it and every later one run as decode
    rows, through the engine's decode write and decode attention (for FP2, the fused decode path)
    exactly as serving runs them; 1 scores the whole text through decode rows (slow: one step per
    token), None through chunks only.

    The sequence takes len(ids) tokens of the engine's partition and is freed afterwards; call it on
    an idle engine of one rank.

    Raises:
        ConfigError: a multi-rank engine, chunk < 1, fewer than 2 tokens.
        KVCapacityError: the partition cannot hold the text.
        ZerodramError: the model's K/V went NaN/Inf (its rows were stored as zeros).
    """
    if engine.world_size != 1:
        raise ConfigError(f"score_tokens runs on a one-rank engine, this one has {engine.world_size}")
    if chunk < 1 or len(ids) < 2:
        raise ConfigError(f"need chunk >= 1 and at least 2 tokens, got {chunk}, {len(ids)}")
    split = len(ids) if decode_from is None else decode_from
    if not 1 <= split <= len(ids):
        raise ConfigError(
            f"decode_from must lie in [1, {len(ids)}] (the first token is prefilled), got {decode_from}"
        )
    # (start, tokens, as a decode row): chunks over [0, split), then one decode row per token
    steps = [(s, min(chunk, split - s), False) for s in range(0, split, chunk)]
    steps += [(s, 1, True) for s in range(split, len(ids))]
    dev = engine.device
    seq_id = engine.new_request_id()
    engine.kv.reserve(seq_id, len(ids))
    logp, top, rows = [], [], []
    try:
        for start, n, as_decode in steps:
            part = ids[start : start + n]
            batch = ForwardBatch(
                token_ids=torch.tensor(part, dtype=torch.int64, device=dev),
                positions=torch.arange(start, start + n, device=dev),
                decode_seq_ids=(seq_id,) if as_decode else (),
                decode_positions=(start,) if as_decode else (),
                prefill=() if as_decode else (PrefillSegment(seq_id, start, n),),
                logits_rows=torch.arange(n, device=dev),
            )
            logits = engine.model.forward(batch, engine.attn).float()  # [n, V]
            # K/V gone NaN/Inf was stored as zeros: a score over those would be quietly wrong
            bad = engine.kv.take_nonfinite()
            if bad:
                raise ZerodramError(f"scoring stopped at tokens {start}..{start + n - 1}: {bad.get(seq_id, bad)}")
            nxt = torch.tensor(ids[start + 1 : start + n + 1], device=dev)  # the last chunk has one fewer
            lp = torch.log_softmax(logits[: nxt.numel()], -1)
            logp.append(lp.gather(1, nxt[:, None])[:, 0].cpu())
            top.append(lp.argmax(-1).cpu())
            if keep_logits:
                rows.append(logits[: nxt.numel()].cpu())
    finally:
        engine.kv.free(seq_id)
    return TokenScores(torch.cat(logp), torch.cat(top), torch.cat(rows) if keep_logits else None)
