"""Passkey retrieval: a random 5-digit key hidden at a given depth in filler text.

Scored teacher-forced: the prompt plus the answer is run once, and a trial passes when the model's
argmax at every answer position is the answer token (what greedy decoding would produce).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zerodram.runtime.kv_eval.hook import CodecSession

_INTRO = "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about it.\n"
_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class NeedleTrial:
    """One prompt: input ids [1, T] and the positions whose next-token argmax must match."""

    ids: torch.Tensor
    answer_pos: torch.Tensor  # [A] positions p: logits[p] must predict ids[p + 1]
    depth: float
    key: str

    def answered(self, pred: torch.Tensor) -> bool:
        """pred [A]: the greedy next token at each of answer_pos. The trial passes when every one is
        the answer's token (what greedy decoding would produce)."""
        return bool((pred.to(self.ids.device) == self.ids[0, self.answer_pos + 1]).all())


def make_trials(
    enc: Callable[[str], list[int]], ctx: int, num_trials: int, seed: int = 0
) -> list[NeedleTrial]:
    """`num_trials` prompts of about `ctx` tokens, depths spread over [0.1, 0.9]; `enc` tokenizes
    without special tokens (the harness's Hugging Face tokenizer and the engine's alike)."""
    rng = random.Random(seed)
    filler = enc(_FILLER)
    out = []
    for i in range(num_trials):
        depth = 0.1 + 0.8 * (i / max(num_trials - 1, 1))
        key = f"{rng.randint(10000, 99999)}"
        needle = enc(f" The pass key is {key}. Remember it. {key} is the pass key. ")
        head, tail = enc(_INTRO), enc(_QUESTION)
        answer = enc(f" {key}")
        budget = ctx - len(head) - len(needle) - len(tail) - len(answer)
        n_fill = max(budget // len(filler), 2)
        before = int(n_fill * depth)
        body = head + filler * before + needle + filler * (n_fill - before) + tail
        ids = torch.tensor(body + answer)[None]
        pos = torch.arange(len(body) - 1, len(body) - 1 + len(answer))
        out.append(NeedleTrial(ids=ids, answer_pos=pos, depth=depth, key=key))
    return out


def pass_rate(session: CodecSession, trials: list[NeedleTrial]) -> float:
    """Fraction of trials whose whole answer is the argmax continuation."""
    ok = 0
    for t in trials:
        logits = session.forward(t.ids).logits[0]
        ok += t.answered(logits[t.answer_pos].argmax(-1))
    return ok / max(len(trials), 1)
