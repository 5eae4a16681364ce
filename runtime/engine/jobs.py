"""What the serving commands share: engine options, building from them, and the JSON-lines loop.

    engine = build_from_args(args, ctx)                 # after add_engine_args(parser)
    err = serve_lines(engine, sys.stdin.buffer, sys.stdout)  # every rank; rank 0 reads and writes, and
                                                            # gets the error that ended its input early

The worker jobs `serve` and `demo` themselves live in launch/ (they also show the dashboard).
serve_lines: rank 0 reads one JSON object per line:
    {"prompt": "text" | "prompt_ids": [ids], "params": {"max_tokens": 16, "temperature": 0.7,
     "top_p": 0.9, "seed": 1, "stop_token_ids": [], "ignore_eos": false}, "chat": true, "id": any}
and writes one JSON object per finished request:
    {"id": ..., "text": ..., "token_ids": [...], "finish_reason": "stop"|"length"|"error",
     "error": "..." (errors only), "rank": owner rank}
With `stream`, each sampled token first gets a line of its own, in the order tokens are sampled:
    {"id": ..., "token_id": 42, "text": "new text since the last line of this request"}
(the text delta is held back while the decoded text ends in an incomplete character; the final
object's text is always the whole answer). A malformed line gets an error line; the server carries
on. Every rank runs the lockstep loop.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
from dataclasses import replace
from typing import Any

from zerodram.runtime.argtypes import int_at_least
from zerodram.runtime.engine.config import EngineConfig
from zerodram.runtime.engine.request import RequestError, SamplingParams
from zerodram.runtime.engine.scheduler import SchedulerConfig
from zerodram.runtime.errors import ConfigError, ZerodramError
from zerodram.runtime.kv.format import ENGINE_KV_FORMATS, check_engine_kv_format
from zerodram.runtime.topology.placement import EP_WIRES
from zerodram.runtime.topology.schema import KvSpec


def kv_format_arg(text: str) -> str:
    """`--kv`: one of ENGINE_KV_FORMATS or an FP2 spec `fp2:key=value,...` (checked here, at the edge)."""
    try:
        return check_engine_kv_format(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options shared by generate, serve and demo. `--kv` and `--page-size` default to
    the topology's `kv` section (`engine_config`), whose own defaults are `KvSpec`'s."""
    kv = KvSpec()
    p.add_argument("--model", default="smollm2", help="smollm2 | HF dir | file.gguf | random:NAME")
    p.add_argument(
        "--kv",
        type=kv_format_arg,
        default=None,
        help=f"KV page format: {' | '.join(ENGINE_KV_FORMATS)} | fp2:OPTIONS (docs/fp2-format.md); "
        f"default the topology's kv.format, else {kv.format} (calibrated at start, see --kv-calibration); "
        "bare fp2 needs no calibration",
    )
    p.add_argument(
        "--kv-calibration",
        default="auto",
        metavar="auto|none|PATH",
        help="FP2 constants: auto = computed at start when the format needs them (error feedback, "
        "centers, cal levels, anchors), none = uncalibrated fallbacks, PATH = a saved file",
    )
    p.add_argument("--kv-calibration-save", default=None, metavar="PATH", help="save the FP2 constants here")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weights / compute dtype")
    p.add_argument("--experts", type=int_at_least(1), default=None, help="experts to slice a dense model into")
    p.add_argument("--num-kv-pages", type=int, default=512, help="KV pages per rank")
    p.add_argument(
        "--page-size", type=int, default=None, help=f"tokens per KV page (default the topology's kv.page_size, else {kv.page_size})"
    )
    p.add_argument("--max-num-seqs", type=int, default=16, help="running requests per rank")
    p.add_argument("--max-step-tokens", type=int, default=256, help="tokens per step per rank")
    p.add_argument("--prefill-chunk", type=int, default=128, help="prompt tokens per request per step")
    p.add_argument("--ep-backend", default=None, help="auto | torch | nvshmem | allgather")
    p.add_argument(
        "--ep-wire",
        choices=EP_WIRES,
        default=None,
        help="how the dispatch sends a token's row to its experts' ranks: bf16 (the rows as they are, in "
        "the model's --dtype), or fp8 (e4m3 values and one scale per 128 channels: about half a bf16 "
        "row's bytes, a quarter of an fp32 row's; needs hidden %% 128 == 0). The combine "
        "returns the model's rows either way; one rank sends nothing (default the topology's "
        "experts.wire, else bf16)",
    )
    p.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="capture the decode step in CUDA graphs (GPU jobs; ignored on the CPU): auto = "
        "where they serve (one rank, or ranks over the NVSHMEM backend; no MoE layer a graph would "
        "run dense), eager otherwise or if the capture fails; on = capture or fail; off = eager",
    )
    p.add_argument(
        "--defer-write",
        choices=("auto", "on", "off"),
        default="auto",
        help="make each layer's FP2 KV write after its decode in the captured steps, beside the rest of "
        "the step (GPU): auto = wherever the kernels and the format allow (a window); on = every "
        "captured step, or fail; off = a launch of its own before the decode",
    )


def engine_config(args: argparse.Namespace, topology: Any = None) -> EngineConfig:
    """EngineConfig from the shared options (the engine refuses graphs it cannot capture); the KV
    format and page size not given take the topology's `kv` defaults (`KvSpec`'s without one)."""
    graphs = {"on": True, "off": False}.get(args.cuda_graphs, "auto")
    defer_write = {"on": True, "off": False}.get(args.defer_write, "auto")
    kv = topology.kv if topology is not None else KvSpec()
    return EngineConfig(
        kv_format=args.kv if args.kv is not None else kv.format,
        kv_calibration=args.kv_calibration,
        kv_calibration_save=args.kv_calibration_save,
        num_kv_pages=args.num_kv_pages,
        page_size=args.page_size if args.page_size is not None else kv.page_size,
        scheduler=SchedulerConfig(args.max_num_seqs, args.max_step_tokens, args.prefill_chunk),
        cuda_graphs=graphs,
        defer_write=defer_write,
    )


def ep_wire(args: argparse.Namespace, topology: Any = None) -> str:
    """The dispatch's wire: `--ep-wire`, else the topology's `experts.wire`, else bf16."""
    if args.ep_wire is not None:
        return args.ep_wire
    return topology.experts.wire if topology is not None else "bf16"


def convert_once_per_node(model: str, ctx: Any) -> None:
    """A GGUF model (the packaged one too) is converted to a cached HF-style dir by one rank per
    node while the others wait: converting dequantizes the whole file, which every rank doing at
    once would multiply in memory and time. A no-op for other models and for converted files."""
    from zerodram.runtime.loading.checkpoint import ModelSpec, checkpoint_dir
    from zerodram.runtime.loading.convert import converted_dir

    spec = ModelSpec.parse(model)
    if spec.kind != "gguf":
        return
    if getattr(ctx, "local_rank", 0) == 0 and not (converted_dir(spec.path) / "model.safetensors").is_file():
        print(
            f"zerodram: converting {spec.path.name} once (cached for later runs)", file=sys.stderr, flush=True
        )
        checkpoint_dir(spec)
    # every rank takes the barrier, converted or not: a rank that skipped it would pair its next
    # barrier with this one on the others
    if getattr(ctx, "world_size", 1) > 1:
        ctx.barrier(f"{spec.path.name} converted by each node's local rank 0")


def build_from_args(args: argparse.Namespace, ctx: Any, **kw: Any) -> Any:
    """`build_engine` from parsed engine options; falls back to bf16 pages when FP2 is missing."""
    from zerodram.runtime.engine.build import build_engine

    convert_once_per_node(args.model, ctx)
    config = engine_config(args, getattr(ctx, "topology", None))

    def build(config: EngineConfig) -> Any:
        return build_engine(
            args.model, ctx, config, dtype=args.dtype, num_experts=args.experts, ep_backend=args.ep_backend,
            ep_wire=ep_wire(args, getattr(ctx, "topology", None)), **kw
        )

    try:
        engine = build(config)
        if engine.kv_calibration is not None and getattr(ctx, "rank", 0) == 0:
            print(engine.kv_calibration.summary, file=sys.stderr, flush=True)
        return engine
    except ConfigError as err:
        if not config.kv_format.startswith("fp2") or "runtime/kv" not in str(err):
            raise
        if getattr(ctx, "rank", 0) == 0:
            print(f"note: {err}; using bf16 KV pages", file=sys.stderr)
        return build(replace(config, kv_format="bf16"))


class LineSource:
    """Rank 0's JSON-lines request reader: a thread fills a queue; the step loop polls it.

    `stream` yields lines as bytes (each decoded here, so that one line that is not UTF-8 gets an
    error result and the rest are served) or as str. A read that fails ends the input: the
    requests read before it are served, then `serve_lines` raises the failure (`error`).
    """

    def __init__(self, engine: Any, stream: Any) -> None:
        self.engine = engine
        self._q: queue.Queue = queue.Queue()
        self._eof = threading.Event()
        self._next = 0
        self.keys: dict[int, Any] = {}  # request -> the id its result carries, until that result
        self.error: Exception | None = None
        self.lines_read = 0  # request lines queued by the reader thread
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True, name="serve-input")
        self._thread.start()

    def _read(self, stream: Any) -> None:
        try:
            for line in stream:
                if line.strip():
                    self.lines_read += 1
                    self._q.put(line)
        except Exception as err:  # any read failure: raised on the main thread, at the end
            self.error = err
        finally:
            self._eof.set()

    def poll(self) -> list[tuple[int, Any, SamplingParams]]:
        items = []
        while True:
            try:
                line = self._q.get_nowait()
            except queue.Empty:
                return items
            rid = self._next
            self._next += 1
            items.append(self._parse(rid, line))

    def _parse(self, rid: int, line: str | bytes) -> tuple[int, Any, SamplingParams]:
        try:
            if isinstance(line, bytes):
                try:
                    line = line.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise RequestError(f"the line is not UTF-8: byte 0x{line[err.start]:02x} at byte {err.start}") from None
            d = json.loads(line)
            if not isinstance(d, dict):
                raise RequestError("each line must be a JSON object")
            self.keys[rid] = d.get("id", rid)
            params = SamplingParams.from_dict(d.get("params", {}))
            if "prompt_ids" in d:
                if not isinstance(d["prompt_ids"], list):
                    raise RequestError('"prompt_ids" must be a list of ints')
                return rid, d["prompt_ids"], params
            if not isinstance(d.get("prompt"), str):
                raise RequestError('a request needs "prompt" (string) or "prompt_ids" (list of ints)')
            return rid, self.engine.encode(d["prompt"], bool(d.get("chat", False))), params
        except (json.JSONDecodeError, RequestError, ConfigError, TypeError, ValueError) as err:
            self.keys.setdefault(rid, rid)
            return rid, RequestError(f"bad request line: {err}"), SamplingParams()

    @property
    def closed(self) -> bool:
        return self._eof.is_set() and self._q.empty()


class TextDeltas:
    """Per request, the text its newest token adds, from a short window of recent tokens (not the
    whole answer decoded again per token): decode the tokens since the last emission together
    with the ones before them, emit what the newest add, hold back while the text ends in U+FFFD
    (a character whose bytes have not all arrived). Byte-level and Metaspace decoders are
    prefix-stable, so the deltas add up to the whole text."""

    def __init__(self, decode: Any) -> None:
        self.decode = decode
        self._offsets: dict[int, tuple[int, int]] = {}  # request -> (prefix start, read end)

    def delta(self, request_id: int, ids: list[int]) -> str:
        start, read = self._offsets.get(request_id, (0, 0))
        before, text = self.decode(ids[start:read]), self.decode(ids[start:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self._offsets[request_id] = (read, len(ids))
        return text[len(before) :]

    def forget(self, request_id: int) -> None:
        self._offsets.pop(request_id, None)


def serve_lines(engine: Any, fin: Any, fout: Any, *, stream: bool = False) -> ZerodramError | None:
    """Serve JSON-lines requests from `fin` until it ends (see the module docstring).

    Collective: every rank calls it; only rank 0 reads `fin` and writes `fout` (others pass None).
    stream: a line per sampled token before each request's final line.

    Returns:
        rank 0: the error that ended reading `fin` early, if one did (the requests read before it
        were served); the caller raises it once the ranks are done together. Else None.
    """
    from zerodram.runtime.engine.lockstep import ListSource, run_lockstep

    if engine.rank != 0:
        for _ in run_lockstep(engine, ListSource([])):
            pass
        return None
    source = LineSource(engine, fin)
    tokens: dict[int, list[int]] = {}
    deltas = TextDeltas(engine.tokenizer.decode) if stream and engine.tokenizer is not None else None
    for ev in run_lockstep(engine, source):
        if ev.token_id is not None:
            ids = tokens.setdefault(ev.request_id, [])
            ids.append(ev.token_id)
            if stream:
                rec = {"id": source.keys.get(ev.request_id, ev.request_id), "token_id": ev.token_id}
                if deltas is not None:
                    rec["text"] = deltas.delta(ev.request_id, ids)
                fout.write(json.dumps(rec) + "\n")
                fout.flush()
        if ev.finish_reason is None:
            continue
        if deltas is not None:
            deltas.forget(ev.request_id)
        ids = tokens.pop(ev.request_id, [])
        rec = {
            "id": source.keys.pop(ev.request_id, ev.request_id),
            "finish_reason": ev.finish_reason,
            "token_ids": ids,
            "rank": ev.rank,
        }
        if ev.error is not None:
            rec["error"] = ev.error
        elif engine.tokenizer is not None:
            rec["text"] = engine.tokenizer.decode(ids)
        fout.write(json.dumps(rec) + "\n")
        fout.flush()
    if source.error is None:
        return None
    err = ZerodramError(
        f"reading the requests failed after {source.lines_read} request lines (those were served): "
        f"{type(source.error).__name__}: {source.error}"
    )
    err.__cause__ = source.error
    return err
