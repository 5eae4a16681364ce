"""`ForwardBatch`: the tokens of one engine step, flattened, and what attention needs to know.

Shape legend: T tokens in the step, B decode sequences, S prefill segments.

Rows are ordered decode first, then prefill chunks: rows [0, B) are one new token for each decode
sequence; then each prefill segment's `num_tokens` rows in order. A step may hold zero tokens (a
rank with no work still runs every layer, because the MoE layers are collective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillSegment:
    """`num_tokens` prompt tokens of `seq_id` starting at position `start_pos` (chunked prefill)."""

    seq_id: int
    start_pos: int
    num_tokens: int


@dataclass(frozen=True)
class ForwardBatch:
    """One step's flattened tokens.

    token_ids, positions: [T] int64 on the model's device.
    decode_seq_ids: the B sequences decoding one token each (rows [0, B)).
    decode_positions: their positions (the new token's index in the sequence), host ints.
    prefill: the S prefill segments, rows after the decode rows.
    logits_rows: [N] rows whose logits the step needs (last row of each sequence that samples).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    decode_seq_ids: tuple[int, ...]
    decode_positions: tuple[int, ...]
    prefill: tuple[PrefillSegment, ...]
    logits_rows: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_decode(self) -> int:
        return len(self.decode_seq_ids)

    @classmethod
    def build(
        cls,
        decode: list[tuple[int, int, int]],
        prefill: list[tuple[int, int, list[int]]],
        logits_for_prefill: list[bool],
        device: torch.device,
    ) -> ForwardBatch:
        """Assemble a batch.

        Args:
            decode: (seq_id, position, token_id) per decode sequence.
            prefill: (seq_id, start_pos, token_ids) per prefill chunk.
            logits_for_prefill: per chunk, whether its last row's logits are needed (final chunk).
        """
        ids = [t for _, _, t in decode]
        pos = [p for _, p, _ in decode]
        rows = list(range(len(decode)))
        segs = []
        for (seq_id, start, toks), want in zip(prefill, logits_for_prefill, strict=True):
            ids.extend(toks)
            pos.extend(range(start, start + len(toks)))
            segs.append(PrefillSegment(seq_id, start, len(toks)))
            if want:
                rows.append(len(ids) - 1)
        as_long = {"dtype": torch.int64, "device": device}
        return cls(
            token_ids=torch.tensor(ids, **as_long),
            positions=torch.tensor(pos, **as_long),
            decode_seq_ids=tuple(s for s, _, _ in decode),
            decode_positions=tuple(pos[: len(decode)]),
            prefill=tuple(segs),
            logits_rows=torch.tensor(rows, **as_long),
        )

    @classmethod
    def empty(cls, device: torch.device) -> ForwardBatch:
        """A batch with no tokens: what an idle rank runs so that MoE collectives stay in lockstep."""
        return cls.build([], [], [], device)
