"""`Engine`: one rank's serving loop: scheduler, KV partition, model step, sampler.

    engine = Engine(model, EngineConfig(kv_format="bf16"), tokenizer=tok, ctx=ctx)
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=16))       # rank 0 gets results
    for ev in engine.stream(prompts, params): ...                          # TokenEvents as they come

With several ranks, `generate` / `stream` are collective: every rank calls them; rank 0's prompts
are the ones served (other ranks pass anything, e.g. []), and only rank 0 gets results. The loop
that keeps ranks in lockstep lives in `lockstep.py`; this module is the per-rank step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import torch

from zerodram.runtime.engine.calibration import engine_calibration
from zerodram.runtime.engine.config import EngineConfig, StepStats
from zerodram.runtime.engine.fp2_decode import Fp2FusedDecode, make_decode_attention
from zerodram.runtime.engine.graphs import DecodeGraphs
from zerodram.runtime.engine.kv import KVPartition, make_kv_partition
from zerodram.runtime.engine.request import (
    Request,
    RequestError,
    RequestOutput,
    SamplingParams,
    TokenEvent,
    validate,
)
from zerodram.runtime.engine.sampler import make_generator, sample
from zerodram.runtime.engine.scheduler import Scheduler
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.model.attention import KVProbe, PagedAttention
from zerodram.runtime.model.ep import capturable_ep
from zerodram.runtime.model.transformer import Transformer

log = logging.getLogger("zerodram.engine")


class Engine:
    """One rank's engine. See the module docstring for the collective contract.

    Args:
        model: this rank's `Transformer` (its experts' EP layers already bound to the world).
        config: KV partition and scheduler limits.
        tokenizer: encodes str prompts and decodes outputs (optional: token-id prompts work without).
        ctx: the rank context (None: a single process, no communication).
        on_step: called with each step's `StepStats` (metrics hook; must be cheap).
    """

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig | None = None,
        *,
        tokenizer: object | None = None,
        ctx: object | None = None,
        on_step: Callable[[StepStats], None] | None = None,
    ) -> None:
        self.model = model
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.ctx = ctx
        self.rank = getattr(ctx, "rank", 0)
        self.world_size = getattr(ctx, "world_size", 1)
        self.on_step = on_step
        mc = model.config
        self.device = model.device
        cfg = self.config
        self.kv_calibration = engine_calibration(
            model,
            cfg.kv_format,
            cfg.kv_calibration,
            tokenizer=tokenizer,
            ctx=ctx,
            num_tokens=cfg.kv_calibration_tokens,
            chunk=cfg.scheduler.max_step_tokens,
            save_path=cfg.kv_calibration_save,
        )
        self.kv: KVPartition = make_kv_partition(
            cfg.kv_format,
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            cfg.num_kv_pages,
            cfg.page_size,
            model.dtype,
            self.device,
            kv_params=self.kv_calibration.params if self.kv_calibration is not None else None,
        )
        scale = mc.head_dim**-0.5
        decode = None
        if self.config.fused_decode:
            decode = make_decode_attention(
                self.kv,
                num_q_heads=mc.num_heads,
                scale=scale,
                max_batch=self.config.scheduler.max_num_seqs,
                value_product=self.config.decode_value_product,
                defer_write=self.config.defer_write,
            )
        self.attn = PagedAttention(self.kv, scale, decode)
        self.scheduler = Scheduler(self.kv, self.config.scheduler, self.device)
        self.max_model_len = self.config.max_model_len or mc.max_position_embeddings
        eos = set(mc.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.eos_ids = frozenset(eos)
        self._generators: dict[int, torch.Generator | None] = {}
        self._next_id = 0
        self.step_idx = 0
        self.graphs: DecodeGraphs | None = None
        if self.config.cuda_graphs and self.device.type == "cuda":
            self.graphs = self._capture(self.config.cuda_graphs == "auto")
        self.on_error: Callable[[str], None] | None = None
        # Diagnostics: called each step with the sampled rows' request ids and their logits [N, V]
        # before sampling (tests compare ranks' logits through it; None costs nothing).
        self.on_logits: Callable[[list[int], torch.Tensor], None] | None = None

    def _capture(self, auto: bool) -> DecodeGraphs | None:
        """The decode step's graphs; under "auto", None (eager decode, logged) where they would not
        serve, or where the capture fails on one rank (across ranks a failed capture raises)."""
        reason = None
        uncapturable = [
            layer.idx for layer in self.model.layers if layer.is_moe and capturable_ep(layer.ep) is None
        ]
        if self.world_size > 1 and uncapturable:
            reason = (
                f"MoE layers {uncapturable} exchange rows in a way a graph cannot hold (the torch backend's "
                f"host-driven exchange, or a communicator whose phase is not pinned); CUDA graphs across "
                f"{self.world_size} ranks need the NVSHMEM backend as ExpertParallelWorld builds it"
            )
        elif auto and (dense := DecodeGraphs.dense_moe_layers(self.model)):
            reason = (
                f"MoE layers {dense} would run every expert on every row inside a graph (weights or "
                "shapes the decode expert kernel does not take)"
            )
        if reason is not None:
            if not auto:
                raise ConfigError(reason)
            log.info("cuda_graphs auto: eager decode (%s)", reason)
            return None
        # The whole step in one graph where the KV writes and the attention have a fixed shape
        # (FP2 through the fused kernels, flushing one token at a time), else piecewise. Across
        # ranks, piecewise only: its graphs are captured here, every rank capturing the same buckets
        # in the same order (the warm-ups run the EP exchange), whereas whole steps are captured
        # at the first use of a (bucket, FP2 length), which differs per rank. Replays and eager
        # steps then mix freely across ranks (the communicators' phases are pinned).
        fused = self.attn.decode if isinstance(self.attn.decode, Fp2FusedDecode) else None
        whole_ok = fused is not None and getattr(self.kv, "static_decode_ok", False) and self.world_size == 1
        static = (self.kv, fused) if whole_ok else None
        try:
            return DecodeGraphs(
                self.model, max_batch=self.config.scheduler.max_num_seqs, capture=True, static=static
            )
        except Exception as err:
            if not auto or self.world_size > 1:
                # across ranks a capture is collective (its warm-ups run the EP exchange in step):
                # a rank that fell back alone would leave its peers' exchanges waiting for it
                raise
            torch.cuda.synchronize()
            log.warning(
                "cuda_graphs auto: capture failed, eager decode: %s",
                str(err).splitlines()[0] if str(err) else err,
            )
            return None

    # --- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """End the model's expert-parallel resources (communicators, the NVSHMEM session).
        Collective: every rank closes, after the same last step. Idempotent."""
        self.model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        # Only a clean exit closes: closing is collective, and after an exception another rank
        # may never arrive (an NVSHMEM barrier has no timeout); process exit tears NVSHMEM down.
        if exc_type is None:
            self.close()

    # --- observation ---------------------------------------------------------------------------

    def attach_observer(
        self,
        timer: object,
        on_step: Callable[[StepStats], None] | None,
        *,
        kv_probe: KVProbe | None = None,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        """Route metrics hooks: phase timing / routing to `timer`, step stats to `on_step`, each
        layer's freshly written K/V (with its queries) to `kv_probe`, refused requests' messages
        (rank 0) and requests stopped for non-finite K/V (any rank) to `on_error`. All are called
        on the step thread and must be cheap."""
        self.model.timer = timer
        for layer in self.model.layers:
            ep = getattr(layer, "ep", None)
            if ep is not None and hasattr(ep, "timer"):
                ep.timer = timer
        self.on_step = on_step
        self.attn.probe = kv_probe
        self.on_error = on_error

    @property
    def expert_to_rank(self) -> tuple[int, ...] | None:
        return getattr(self, "_expert_to_rank", None)

    @property
    def expert_owners(self) -> tuple[tuple[int, ...], ...] | None:
        """Each expert's ranks, primary first (a topology's replicas after it)."""
        return getattr(self, "_expert_owners", None)

    # --- requests ------------------------------------------------------------------------------

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """Token ids of a text prompt (a list of ids passes through). Raises `RequestError` for
        text that is not Unicode (lone surrogates: how Python carries bytes that were not UTF-8,
        from the command line say), `ConfigError` where there is no tokenizer."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("a text prompt needs a tokenizer; pass token ids or load one")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as err:
                c = ord(prompt[err.start])  # U+DC80..U+DCFF: an undecodable byte, escaped
                what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"a lone surrogate U+{c:04X}"
                raise RequestError(f"the prompt is not UTF-8 text: {what} at character {err.start}") from None
            if chat:
                return self.tokenizer.apply_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate(self, request_id: int, prompt_ids: list[int], params: SamplingParams) -> Request:
        """A checked request (raises `RequestError`); limits are those of this rank's partition."""
        return validate(
            request_id,
            prompt_ids,
            params,
            vocab_size=self.model.config.vocab_size,
            max_model_len=self.max_model_len,
            max_seq_tokens=self.kv.num_pages * self.kv.page_size,
        )

    def add_request(self, request: Request) -> None:
        """Queue a validated request on this rank. Raises `RequestError` for an id this rank is
        already serving (the two would share one KV reservation and generator)."""
        if request.request_id in self._generators:
            raise RequestError(f"request id {request.request_id} is already queued or running on this rank")
        self._generators[request.request_id] = make_generator(request.params, request.request_id, self.device)
        self.scheduler.add(request)

    def new_request_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # --- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """Schedule, run the model over the batch (even an empty one: MoE is collective), sample.

        Returns this rank's events of the step: one per sampled token, finishing ones marked.
        """
        t0 = time.perf_counter()
        self.model.timer.begin_step()
        plan = self.scheduler.schedule()
        if self.graphs is not None and self.graphs.eligible(plan.batch):
            logits = self.graphs.run(plan.batch, self.attn)  # [N, V], decode rows only
        else:
            logits = self.model.forward(plan.batch, self.attn)  # [N, V]
        self.model.check_experts()  # a device wait that expired raises here, naming whom it waited for
        events, sampled = self._fail_nonfinite(), plan.sampled
        if events:  # their logits may be NaN: they take no token
            failed = {ev.request_id for ev in events}
            keep = [i for i, r in enumerate(sampled) if r.request_id not in failed]
            sampled, logits = [sampled[i] for i in keep], logits[keep]
        if self.on_logits is not None:
            self.on_logits([r.request_id for r in sampled], logits)
        with self.model.timer.phase("sampling"):
            tokens = sample(
                logits,
                [r.params for r in sampled],
                [self._generators[r.request_id] for r in sampled],
            )
        for req, tok in zip(sampled, tokens, strict=True):
            if tok is None:  # its logits held NaN/Inf: no token to draw, the others go on
                events.append(self._fail(req, f"non-finite logits at output token {len(req.output_ids)}"))
                continue
            req.output_ids.append(tok)
            reason = None
            if (tok in self.eos_ids and not req.params.ignore_eos) or tok in req.params.stop_token_ids:
                reason = "stop"
            elif len(req.output_ids) >= req.params.max_tokens:
                reason = "length"
            if reason is not None:
                self.scheduler.finish(req, reason)
                self._generators.pop(req.request_id, None)
            events.append(TokenEvent(req.request_id, tok, reason, rank=self.rank))
        if self.on_step is not None:
            self.on_step(
                StepStats(
                    self.step_idx,
                    plan.batch.num_decode,
                    plan.num_prefill_tokens,
                    len(self.scheduler.running),
                    len(self.scheduler.waiting),
                    self.kv.num_pages - self.kv.num_free_pages(),
                    self.kv.num_pages,
                    sum(t is not None for t in tokens),
                    *self.kv.stored_bytes(),
                    time.perf_counter() - t0,
                )
            )
        self.step_idx += 1
        return events

    def _fail_nonfinite(self) -> list[TokenEvent]:
        """End the requests whose K/V went NaN/Inf this step (the partition stored zeros instead):
        an error event each, their pages freed; the rest of the batch goes on."""
        events = []
        for rid, message in self.kv.take_nonfinite().items():
            req = next((r for r in self.scheduler.running if r.request_id == rid), None)
            if req is None:  # already gone (cannot happen within a step; nothing to end)
                continue
            events.append(self._fail(req, message))
        return events

    def _fail(self, req: Request, message: str) -> TokenEvent:
        """End one request with an error (its pages freed); the rest of the batch goes on."""
        self.scheduler.finish(req, "error")
        self._generators.pop(req.request_id, None)
        if self.on_error is not None:  # the dashboard's error count and last messages
            self.on_error(f"request {req.request_id} stopped: {message}")
        return TokenEvent(req.request_id, None, "error", error=f"request stopped: {message}", rank=self.rank)

    # --- the Python API ------------------------------------------------------------------------

    def stream(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        chat: bool = False,
    ) -> Iterator[TokenEvent]:
        """Serve `prompts` (rank 0's) and yield `TokenEvent`s as tokens are sampled (rank 0 only).

        Request ids are the prompts' indices. Collective when world_size > 1.
        """
        from zerodram.runtime.engine.lockstep import ListSource, run_lockstep

        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"{len(prompts)} prompts but {len(params)} sampling params")
        items = []
        for i, (p, sp) in enumerate(zip(prompts if self.rank == 0 else [], params, strict=False)):
            try:
                items.append((i, self.encode(p, chat), sp))
            except (ConfigError, RequestError) as err:
                items.append((i, err, sp))
        yield from run_lockstep(self, ListSource(items))

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        chat: bool = False,
        on_event: Callable[[TokenEvent], None] | None = None,
    ) -> list[RequestOutput]:
        """Serve `prompts` to completion; rank 0 returns one `RequestOutput` per prompt, in order."""
        tokens: dict[int, list[int]] = {}
        done: dict[int, TokenEvent] = {}
        for ev in self.stream(prompts, params, chat=chat):
            if on_event is not None:
                on_event(ev)
            if ev.token_id is not None:
                tokens.setdefault(ev.request_id, []).append(ev.token_id)
            if ev.finish_reason is not None:
                done[ev.request_id] = ev
        if self.rank != 0:
            return []
        outs = []
        for i, p in enumerate(prompts):
            ev = done[i]
            ids = tokens.get(i, [])
            text = self.tokenizer.decode(ids) if self.tokenizer is not None and ev.error is None else None
            prompt_ids = p if isinstance(p, list) else []
            outs.append(RequestOutput(i, prompt_ids, ids, ev.finish_reason, text, ev.error, ev.rank))
        return outs
