"""What a KV format costs the served model: teacher-forced perplexity through the engine itself.

    python benchmarks/engine_kv_ppl.py --ctx 1024 --windows 2 --kv bf16 "fp2:fb=1,tail=1,window=47"

No transformers, no fake quantization: `runtime/engine/score.py` prefills `--windows` windows of
`--ctx` pydoc tokens (from token 0, each a fresh sequence) in chunks of `--chunk` tokens through the
engine's model, paged attention and KV partition, built exactly as `zerodram generate` builds it
(FP2 constants from the engine's calibration step, on the end of the same text). The reference is
fp32 KV pages. Prints one JSON line per format (and appends it to
benchmarks/results/engine_kv_ppl.jsonl with --save). Chunks of C tokens let each query see up to
C - 1 extra full-precision keys: `--chunk 1` attends as decode does; `--decode` runs every token
after the first as a decode row, the serving path itself (for FP2 the fused decode attention), and
is slow. `--value-product e4m3` (with --decode) scores FP2 formats again with the decode attention
emulating an FP8 value product (runtime/attention/reference.py, VALUE_PRODUCTS): a probe for kernel
design, docs/fp2-kernel.md "An FP8 value product".
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

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--kv", nargs="+", default=["fp2:fb=1,tail=1,window=47"])
    p.add_argument("--calibration", default="auto", help="auto | none | PATH (EngineConfig.kv_calibration)")
    p.add_argument("--calibration-tokens", type=int, default=CALIB_TOKENS)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--decode", action="store_true", help="score by decode rows (one step per token)")
    p.add_argument(
        "--value-product", nargs="+", default=["exact"], help="exact | e4m3 (FP2 formats, with --decode)"
    )
    p.add_argument("--save", action="store_true", help=f"append the lines to {RESULTS.name}")
    args = p.parse_args()
    if set(args.value_product) != {"exact"} and not args.decode:
        p.error("--value-product other than exact acts on the decode attention: add --decode")

    def nll(kv: str, calibration: str, value_product: str = "exact") -> tuple[float, int, object]:
        cfg = EngineConfig(
            kv_format=kv,
            num_kv_pages=args.ctx // 32 + 2,
            kv_calibration=calibration,
            kv_calibration_tokens=args.calibration_tokens,
            decode_value_product=value_product,
        )
        engine = build_engine(args.model, None, cfg)
        ids = pydoc_ids(engine.tokenizer, args.ctx * args.windows)
        total = 0.0
        for w in range(args.windows):
            s = score_tokens(engine, ids[w * args.ctx : (w + 1) * args.ctx], chunk=args.chunk, decode=args.decode)
            total -= float(s.logprobs.sum())
        return total, args.windows * (args.ctx - 1), engine.kv_calibration

    ref_nll, n, _ = nll("fp32", "none")
    ppl_ref = math.exp(ref_nll / n)
    runs = [(kv, vp) for kv in args.kv for vp in (args.value_product if kv.startswith("fp2") else ["exact"])]
    for kv, vp in runs:
        t0 = time.perf_counter()
        total, n, cal = nll(kv, args.calibration, vp)
        ppl = math.exp(total / n)
        line = {
            "kv": kv,
            "calibration": cal.summary if cal is not None else "none",
            "ctx": args.ctx,
            "windows": args.windows,
            "chunk": "decode" if args.decode else args.chunk,
            "value_product": vp,
            "num_scored": n,
            "ppl": round(ppl, 4),
            "ppl_ref_fp32": round(ppl_ref, 4),
            "rel_delta_ppl": round(ppl / ppl_ref - 1, 5),
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
