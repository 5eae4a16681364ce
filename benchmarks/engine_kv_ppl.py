"""What a KV format costs the served model, through the engine itself: teacher-forced perplexity
and passkey retrieval.

    python benchmarks/engine_kv_ppl.py --ctx 1024 --windows 2 --kv bf16 "fp2:fb=1,tail=1,window=47"
    python benchmarks/engine_kv_ppl.py --windows 0 --needle-trials 6 --value-product exact e4m3

No transformers, no fake quantization: `runtime/engine/score.py` runs the text through the engine's
model, paged attention and KV partition, built exactly as `zerodram generate` builds it (FP2
constants from the engine's calibration step, on the end of the same text). The reference is fp32
KV pages. Prints one JSON line per format (and appends it to benchmarks/results/engine_kv_ppl.jsonl
with --save).

Perplexity: `--windows` windows of `--ctx` pydoc tokens (from token 0, each a fresh sequence),
prefilled in chunks of `--chunk` tokens. Chunks of C tokens let each query see up to C - 1 extra
full-precision keys: `--chunk 1` attends as decode does; `--decode` runs every token after the
first as a decode row, the serving path itself (for FP2 the fused decode attention), and is slow.

Needle (`--needle-trials N`): the quality harness's passkey prompts (runtime/kv_eval/needle.py: a
5-digit key at depths spread over 10-90% of about `--needle-ctx` tokens of filler), each prefilled
in chunks of `--needle-chunk` tokens (serving's step size) up to the question's last token, which
and the answer then run as decode rows. A trial passes when the greedy token at every answer
position is the key's; the answer's summed log-probability is kept beside it, a margin that pass or
fail hides.

`--value-product e4m3` measures FP2 formats again with the decode attention emulating an FP8 value
product (runtime/attention/reference.py, VALUE_PRODUCTS): a probe for kernel design,
docs/fp2-kernel.md "An FP8 value product". It acts on decode rows: with perplexity, add --decode.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "engine_kv_ppl.jsonl"


def main() -> int:
    import torch

    from zerodram.runtime.engine import EngineConfig
    from zerodram.runtime.engine.build import build_engine
    from zerodram.runtime.engine.calibration import CALIB_TOKENS
    from zerodram.runtime.engine.score import pydoc_ids, score_tokens
    from zerodram.runtime.kv_eval.needle import make_trials

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--kv", nargs="+", default=["fp2:fb=1,tail=1,window=47"])
    p.add_argument("--calibration", default="auto", help="auto | none | PATH (EngineConfig.kv_calibration)")
    p.add_argument("--calibration-tokens", type=int, default=CALIB_TOKENS)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--windows", type=int, default=2, help="perplexity windows (0: no perplexity)")
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--decode", action="store_true", help="score perplexity by decode rows (one step per token)")
    p.add_argument("--needle-trials", type=int, default=0, help="passkey prompts (0: none)")
    p.add_argument("--needle-ctx", type=int, default=8192, help="passkey prompt length in tokens (about)")
    p.add_argument("--needle-chunk", type=int, default=256, help="prefill tokens per step of a passkey prompt")
    p.add_argument("--value-product", nargs="+", default=["exact"], help="exact | e4m3 (FP2 formats)")
    p.add_argument("--save", action="store_true", help=f"append the lines to {RESULTS.name}")
    args = p.parse_args()
    if set(args.value_product) != {"exact"} and args.windows and not args.decode:
        p.error("--value-product other than exact acts on the decode attention: add --decode (or --windows 0)")

    def measure(kv: str, calibration: str, value_product: str = "exact") -> dict:
        """Perplexity NLL and the needle trials of one engine, and its calibration's summary."""
        longest = max(args.ctx if args.windows else 0, args.needle_ctx if args.needle_trials else 0)
        cfg = EngineConfig(
            kv_format=kv,
            num_kv_pages=longest // 32 + 4,
            kv_calibration=calibration,
            kv_calibration_tokens=args.calibration_tokens,
            decode_value_product=value_product,
        )
        engine = build_engine(args.model, None, cfg)
        cal = engine.kv_calibration
        out: dict = {"calibration": cal.summary if cal is not None else "none"}
        if args.windows:
            ids = pydoc_ids(engine.tokenizer, args.ctx * args.windows)
            decode_from = 1 if args.decode else None
            wins = [ids[w * args.ctx : (w + 1) * args.ctx] for w in range(args.windows)]
            scores = [score_tokens(engine, w, chunk=args.chunk, decode_from=decode_from) for w in wins]
            nll = -sum(float(s.logprobs.sum()) for s in scores)
            out["nll"], out["num_scored"] = nll, args.windows * (args.ctx - 1)
        if args.needle_trials:
            passed, margins = [], []
            for t in make_trials(engine.tokenizer.encode, args.needle_ctx, args.needle_trials):
                ids = t.ids[0].tolist()
                s = score_tokens(engine, ids, chunk=args.needle_chunk, decode_from=int(t.answer_pos[0]))
                passed.append(t.answered(s.argmax[t.answer_pos]))
                margins.append(round(float(s.logprobs[t.answer_pos].sum()), 4))
            out["passed"], out["margins"] = passed, margins
        return out

    ref = measure("fp32", "none")
    runs = [(kv, vp) for kv in args.kv for vp in (args.value_product if kv.startswith("fp2") else ["exact"])]
    for kv, vp in runs:
        t0 = time.perf_counter()
        m = measure(kv, args.calibration, vp)
        line = {"kv": kv, "calibration": m["calibration"], "value_product": vp}
        if args.windows:
            ppl, ppl_ref = math.exp(m["nll"] / m["num_scored"]), math.exp(ref["nll"] / ref["num_scored"])
            line |= {
                "ctx": args.ctx,
                "windows": args.windows,
                "chunk": "decode" if args.decode else args.chunk,
                "num_scored": m["num_scored"],
                "ppl": round(ppl, 4),
                "ppl_ref_fp32": round(ppl_ref, 4),
                "rel_delta_ppl": round(ppl / ppl_ref - 1, 5),
            }
        if args.needle_trials:
            line |= {
                "needle_ctx": args.needle_ctx,
                "needle_chunk": args.needle_chunk,
                "needle_passed": f"{sum(m['passed'])}/{args.needle_trials}",
                "needle_passed_ref_fp32": f"{sum(ref['passed'])}/{args.needle_trials}",
                "needle_pass_by_trial": m["passed"],
                "needle_answer_logprob": m["margins"],
                "needle_answer_logprob_ref_fp32": ref["margins"],
            }
        line |= {
            "seconds": round(time.perf_counter() - t0, 1),
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
        }
        print(json.dumps(line), flush=True)
        if args.save:
            with RESULTS.open("a") as f:
                f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
