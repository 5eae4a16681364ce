"""`zerodram generate`: one process, one or more prompts, text out (streamed as it comes).

zerodram generate --prompt "What is the capital of France?" --max-tokens 32 --kv bf16

All experts local, on a GPU when one is visible (`--device cpu` to stay on the host).
"""

from __future__ import annotations

import argparse
import sys


def _cmd(args: argparse.Namespace) -> int:
    from zerodram.runtime.context import one_process_context
    from zerodram.runtime.engine.jobs import TextDeltas, build_from_args
    from zerodram.runtime.engine.request import SamplingParams

    engine = build_from_args(args, one_process_context(args.device))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    prompts = list(args.prompt)
    stream = len(prompts) == 1 and engine.tokenizer is not None

    # Text as it comes, a character whose bytes span tokens once all have arrived (TextDeltas);
    # a stop token's text is not printed.
    deltas = TextDeltas(engine.tokenizer.decode) if stream else None
    ids: list[int] = []
    printed: list[str] = []

    def on_event(ev) -> None:
        if deltas is not None and ev.token_id is not None and ev.finish_reason != "stop":
            ids.append(ev.token_id)
            printed.append(deltas.delta(ev.request_id, ids))
            sys.stdout.write(printed[-1])
            sys.stdout.flush()

    outs = engine.generate(prompts, params, chat=not args.raw, on_event=on_event)
    for prompt, out in zip(prompts, outs, strict=True):
        if out.error is not None:
            print(f"error: {out.error}", file=sys.stderr)
            continue
        if stream:  # what TextDeltas still held back (an incomplete last character)
            print(engine.tokenizer.decode(ids)[len("".join(printed)) :])
        else:
            print(f"> {prompt}\n{out.text if out.text is not None else out.token_ids}\n")
        print(
            f"[{len(out.token_ids)} tokens, {out.finish_reason}, kv {engine.kv.kv_format}]", file=sys.stderr
        )
    return 1 if any(o.error for o in outs) else 0


def register(sub: argparse._SubParsersAction) -> None:
    from zerodram.runtime.argtypes import int_at_least
    from zerodram.runtime.engine.jobs import add_engine_args

    p = sub.add_parser(
        "generate",
        help="generate text for prompts in this process (no torchrun)",
        description="Load a model in this process and generate for each --prompt (text: the model "
        "needs a tokenizer; a random:NAME model has none, so serve it token ids instead: zerodram serve "
        "with \"prompt_ids\" request lines).",
    )
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int_at_least(1), default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="no chat template: the prompt as plain text")
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: a GPU when one is visible"
    )
    add_engine_args(p)
    p.set_defaults(func=_cmd)
