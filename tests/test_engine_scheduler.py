"""Engine on one rank: continuous batching, chunked prefill, admission control, bad requests,
stop conditions, streaming, the serve job's JSON lines. Tiny random weights (no transformers)."""

from __future__ import annotations

import json

import pytest

from zerodram.runtime.engine import Engine, EngineConfig, SamplingParams, SchedulerConfig
from zerodram.runtime.engine.build import build_engine
from zerodram.runtime.engine.request import RequestError
from zerodram.runtime.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [200, 3], [17] * 13, [40, 41, 42, 43]]


def _engine(num_pages: int = 64, page_size: int = 4, sched: SchedulerConfig | None = None) -> Engine:
    cfg = EngineConfig(
        kv_format="fp32",
        num_kv_pages=num_pages,
        page_size=page_size,
        scheduler=sched or SchedulerConfig(8, 32, 5),
    )
    return build_engine("random:tiny-moe", None, cfg)


def test_batching_does_not_change_greedy_tokens() -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    together = [o.token_ids for o in _engine().generate(PROMPTS, params)]
    alone = [_engine(sched=SchedulerConfig(1, 1, 1)).generate([p], params)[0].token_ids for p in PROMPTS]
    assert together == alone
    assert all(len(t) == 6 for t in together)


def test_admission_waits_for_pages_and_rejects_what_never_fits() -> None:
    # 4 pages x 4 tokens = 16 tokens per rank: each 7+6-token request needs 4 pages -> one at a time
    engine = _engine(num_pages=4, page_size=4)
    seen_running = []
    engine.on_step = lambda s: seen_running.append(s.num_running)
    outs = engine.generate([PROMPTS[0], PROMPTS[0], [1] * 20], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length", "length", "error"]
    assert outs[0].token_ids == outs[1].token_ids
    assert "can never fit" in outs[2].error
    assert max(seen_running) == 1
    assert engine.kv.num_free_pages() == 4


def test_bad_requests_get_errors_and_the_engine_carries_on() -> None:
    engine = _engine()
    prompts = [[], [5, 6], [10**6], [7] * 600, [8, 9]]
    params = [SamplingParams(max_tokens=3)] * 4 + [SamplingParams(max_tokens=3, ignore_eos=True)]
    outs = engine.generate(prompts, params)
    assert [o.finish_reason for o in outs[:4]] == ["error", "length", "error", "error"]
    assert "empty prompt" in outs[0].error
    assert "vocabulary" in outs[2].error
    assert "exceeds the model" in outs[3].error
    assert outs[4].finish_reason == "length"
    assert len(outs[4].token_ids) == 3
    for bad in (
        {"max_tokens": 0},
        {"max_tokens": True},
        {"temperature": -1.0},
        {"temperature": True},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"seed": 2**70},
        {"seed": -1},
        {"seed": 1.5},
        {"stop_token_ids": ("7",)},
    ):
        with pytest.raises(RequestError):
            SamplingParams(**bad).check()
    for bad in ({"stop_token_ids": 7}, {"ignore_eos": "yes"}):
        with pytest.raises(RequestError):
            SamplingParams.from_dict(bad)
    # valid but extreme: a tiny temperature is greedy, the largest seed is a seed
    greedy, tiny_t, big_seed = engine.generate(
        [[5, 6]] * 3,
        [
            SamplingParams(max_tokens=3, ignore_eos=True),
            SamplingParams(max_tokens=3, temperature=1e-40, ignore_eos=True),
            SamplingParams(max_tokens=3, temperature=0.7, seed=2**64 - 1, ignore_eos=True),
        ],
    )
    assert tiny_t.token_ids == greedy.token_ids
    assert big_seed.finish_reason == "length", big_seed.error
    out = engine.generate([[5, 6]], SamplingParams(max_tokens=2, top_p=2.0))[0]
    assert out.finish_reason == "error"
    assert "top_p" in out.error
    with pytest.raises(RequestError, match="unknown sampling"):
        SamplingParams.from_dict({"max_token": 3})
    with pytest.raises(ConfigError, match="tokenizer"):
        engine.encode("text without a tokenizer")


def test_non_finite_logits_fail_only_their_request(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine()
    forward, schedule, plans = engine.model.forward, engine.scheduler.schedule, []

    def remember():  # the step's plan: row i of the logits is plans[-1].sampled[i]
        plans.append(schedule())
        return plans[-1]

    def poisoned(batch, attn):  # the row of request 1 goes NaN from its third token on
        logits = forward(batch, attn)
        for row, req in enumerate(plans[-1].sampled):
            if req.request_id == 1 and len(req.output_ids) >= 2:
                logits[row] = float("nan")
        return logits

    monkeypatch.setattr(engine.scheduler, "schedule", remember)
    monkeypatch.setattr(engine.model, "forward", poisoned)
    outs = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=5, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "non-finite logits at output token 2" in outs[1].error
    assert len(outs[1].token_ids) == 2
    assert engine.kv.num_free_pages() == 64


def test_stop_tokens_max_tokens_and_streaming() -> None:
    engine = _engine()
    first = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    stopped = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4, stop_token_ids=(first[1],)))[0]
    assert stopped.token_ids == first[:2]
    assert stopped.finish_reason == "stop"
    events = list(engine.stream([PROMPTS[0], PROMPTS[1]], SamplingParams(max_tokens=3, ignore_eos=True)))
    assert [e.token_id for e in events if e.request_id == 0] == first[:3]
    assert [e.finish_reason for e in events if e.finish_reason] == ["length", "length"]


def test_seeded_sampling_is_reproducible_across_engines() -> None:
    p = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    a = _engine().generate([PROMPTS[2], PROMPTS[0]], p)
    b = _engine().generate([PROMPTS[0], PROMPTS[2]], p)
    assert a[0].token_ids == b[1].token_ids
    assert a[1].token_ids == b[0].token_ids


def test_empty_step_is_a_noop() -> None:
    engine = _engine()
    assert engine.step() == []
    assert not engine.has_work


def test_serve_lines_json_lines(tmp_path) -> None:
    from zerodram.runtime.engine.jobs import serve_lines

    lines = [
        json.dumps({"prompt_ids": [5, 6, 7], "params": {"max_tokens": 3, "ignore_eos": True}, "id": "a"}),
        "not json",
        json.dumps({"prompt_ids": [], "id": "empty"}),
        json.dumps(
            {
                "prompt_ids": [9, 9],
                "params": {"max_tokens": 2, "temperature": 0.5, "seed": 1, "ignore_eos": True},
            }
        ),
        json.dumps({"prompt": "text without a tokenizer", "id": "text"}),
        json.dumps({"prompt_ids": [1, 2], "params": {"max_tokens": "3"}, "id": "str"}),
        json.dumps({"prompt_ids": 5, "id": "int"}),
        json.dumps([1, 2, 3]),
        json.dumps({"prompt_ids": [1, 2], "params": {"top_p": 0.5, "stop_token_ids": 7}, "id": "stops"}),
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    with inp.open() as fin, out.open("w") as fout:
        serve_lines(_engine(), fin, fout)
    recs = {str(r["id"]): r for r in map(json.loads, out.read_text().splitlines())}
    assert len(recs) == len(lines)
    assert recs["a"]["finish_reason"] == "length"
    assert len(recs["a"]["token_ids"]) == 3
    assert recs["1"]["finish_reason"] == "error"
    assert "bad request line" in recs["1"]["error"]
    assert "empty prompt" in recs["empty"]["error"]
    assert len(recs["3"]["token_ids"]) == 2
    assert "tokenizer" in recs["text"]["error"]
    assert "max_tokens" in recs["str"]["error"]
    for key in ("int", "7", "stops"):
        assert recs[key]["finish_reason"] == "error", recs[key]


def test_serve_lines_streams_a_line_per_token(tmp_path) -> None:
    from zerodram.runtime.engine.jobs import serve_lines

    lines = [json.dumps({"prompt_ids": p, "params": {"max_tokens": 3, "ignore_eos": True}, "id": i})
             for i, p in enumerate(PROMPTS[:2])]  # fmt: skip
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    with inp.open() as fin, out.open("w") as fout:
        serve_lines(_engine(), fin, fout, stream=True)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    for i in range(2):
        mine = [r for r in recs if r["id"] == i]
        assert [r["token_id"] for r in mine[:-1]] == mine[-1]["token_ids"]  # tokens, then the result
        assert mine[-1]["finish_reason"] == "length" and len(mine) == 4


def test_text_deltas_hold_back_incomplete_characters() -> None:
    from zerodram.runtime.engine.jobs import TextDeltas

    pieces = {1: b"caf", 2: b"\xc3", 3: b"\xa9", 4: b" ok"}  # "é" arrives in two tokens
    deltas = TextDeltas(lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace"))
    ids, got = [], []
    for t in (1, 2, 3, 4):
        ids.append(t)
        got.append(deltas.delta(7, ids))
    assert got == ["caf", "", "é", " ok"]


def test_kv_options_default_to_the_topology_and_override_it() -> None:
    import argparse
    from types import SimpleNamespace

    from zerodram.runtime.engine.jobs import add_engine_args, engine_config
    from zerodram.runtime.kv.format import DEFAULT_FP2
    from zerodram.runtime.topology.schema import KvSpec

    p = argparse.ArgumentParser()
    add_engine_args(p)
    topo = SimpleNamespace(kv=KvSpec(format="bf16", page_size=64))

    def kv(argv: list[str], topology: object = None) -> tuple[str, int]:
        c = engine_config(p.parse_args(argv), topology)
        return c.kv_format, c.page_size

    assert kv([]) == (DEFAULT_FP2, 32)  # no topology: KvSpec's defaults
    assert kv([], topo) == ("bf16", 64)
    assert kv(["--kv", "fp8", "--page-size", "16"], topo) == ("fp8", 16)
    with pytest.raises(SystemExit):  # argparse names the bad value and exits 2
        p.parse_args(["--kv", "fp3"])


def test_the_ep_wire_defaults_to_the_topology_and_overrides_it() -> None:
    import argparse
    from types import SimpleNamespace

    from zerodram.runtime.engine.jobs import add_engine_args, ep_wire

    p = argparse.ArgumentParser()
    add_engine_args(p)
    fp8 = SimpleNamespace(experts=SimpleNamespace(wire="fp8"))
    assert ep_wire(p.parse_args([])) == "bf16"  # no topology
    assert ep_wire(p.parse_args([]), fp8) == "fp8"
    assert ep_wire(p.parse_args(["--ep-wire", "bf16"]), fp8) == "bf16"
    with pytest.raises(SystemExit):
        p.parse_args(["--ep-wire", "fp4"])


def test_graph_options_map_to_the_engine_config() -> None:
    import argparse

    from zerodram.runtime.engine.jobs import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])).cuda_graphs == "auto"  # the engine decides
    assert engine_config(p.parse_args(["--cuda-graphs", "on"])).cuda_graphs is True
    assert engine_config(p.parse_args(["--cuda-graphs", "off"])).cuda_graphs is False
    assert engine_config(p.parse_args([])).defer_write == "auto"
    assert engine_config(p.parse_args(["--defer-write", "on"])).defer_write is True
    assert engine_config(p.parse_args(["--defer-write", "off"])).defer_write is False


def test_a_line_that_is_not_utf8_is_refused_alone_and_token_ids_must_be_integers(tmp_path) -> None:
    from zerodram.runtime.engine.jobs import serve_lines

    ok = {"prompt_ids": [5, 6], "params": {"max_tokens": 2, "ignore_eos": True}}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(
        b"\n".join(
            [
                json.dumps(ok | {"id": "first"}).encode(),
                b'{"prompt_ids": [5], "id": "caf\xe9"}',  # a Latin-1 byte: not UTF-8
                json.dumps({"prompt_ids": "hello", "id": "str"}).encode(),
                json.dumps({"prompt_ids": [True, False], "id": "bools"}).encode(),
                json.dumps({"prompt_ids": [5.0, 6], "id": "floats"}).encode(),
                json.dumps(ok | {"id": "last"}).encode(),
            ]
        )
        + b"\n"
    )
    with inp.open("rb") as fin, out.open("w") as fout:  # as `zerodram serve` opens it
        serve_lines(_engine(), fin, fout)
    recs = {str(r["id"]): r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["first"]["finish_reason"] == recs["last"]["finish_reason"] == "length"
    assert "not UTF-8: byte 0xe9 at byte 30" in recs["1"]["error"]
    assert "must be a list" in recs["str"]["error"]
    assert "item 0 is True (bool)" in recs["bools"]["error"]
    assert "item 0 is 5.0 (float)" in recs["floats"]["error"]
    np = pytest.importorskip("numpy")
    out_np = _engine().generate([[np.int64(5), 6]], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert out_np.finish_reason == "length", out_np.error


def test_a_failing_input_stream_serves_what_was_read_then_says_so(tmp_path) -> None:
    from zerodram.runtime.engine.jobs import serve_lines
    from zerodram.runtime.errors import ZerodramError

    def lines():
        yield json.dumps({"prompt_ids": [5, 6], "params": {"max_tokens": 2, "ignore_eos": True}, "id": "a"})
        raise OSError("the pipe broke")

    out = tmp_path / "out.jsonl"
    with out.open("w") as fout:
        err = serve_lines(_engine(), lines(), fout)  # returned, for serve to raise after its barriers
    assert isinstance(err, ZerodramError)
    assert "after 1 request lines (those were served): OSError: the pipe broke" in str(err)
    assert [json.loads(x)["finish_reason"] for x in out.read_text().splitlines()] == ["length"]


def test_text_that_is_not_unicode_and_a_duplicate_id_are_refused() -> None:
    engine = _engine()
    chars = {"encode": staticmethod(lambda s: [ord(c) % 200 + 1 for c in s]), "decode": staticmethod(str)}
    engine.tokenizer = type("Chars", (), chars)()  # a token per character
    with pytest.raises(RequestError, match="not UTF-8 text: byte 0xe9 at character 3"):
        engine.encode("caf\udce9")  # how Python carries the byte 0xe9 of a Latin-1 command line
    outs = engine.generate(["caf\udce9", "cafe"], SamplingParams(max_tokens=2, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["error", "length"]
    req = engine.validate(7, [5, 6], SamplingParams(max_tokens=2))
    engine.add_request(req)
    with pytest.raises(RequestError, match="request id 7 is already queued or running"):
        engine.add_request(engine.validate(7, [8, 9], SamplingParams(max_tokens=2)))


def test_a_kv_partition_past_memory_and_zero_experts_are_refused_by_name() -> None:
    import argparse

    from zerodram.runtime.engine.jobs import add_engine_args

    for kv, pages in (("fp32", 10**12), ("fp32", 10**17), ("bf16", 10**12)):  # allocator, size, page list
        cfg = EngineConfig(kv_format=kv, num_kv_pages=pages, page_size=32, scheduler=SchedulerConfig(8, 32, 5))
        with pytest.raises(ConfigError, match="does not fit in cpu memory: lower --num-kv-pages"):
            build_engine("random:tiny-moe", None, cfg)
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(p)
    with pytest.raises(argparse.ArgumentError, match="expected an integer >= 1, got '0'"):
        p.parse_args(["--experts", "0"])
