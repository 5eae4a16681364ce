"""Loading: expert placement, sharded safetensors reads, GGUF tensors and tokenizer, random weights,
and the checkpoints refused at load (by file and tensor) instead of served wrong."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.loading.checkpoint import ModelSpec, load_for_rank
from zerodram.runtime.loading.placement import expert_layout
from zerodram.runtime.loading.random_init import random_weights
from zerodram.runtime.loading.sources import SafetensorsDir
from zerodram.runtime.loading.weights import load_model_weights
from zerodram.runtime.model.config import ModelConfig
from zerodram.runtime.model.named import named_config


def test_contiguous_placement_and_topology_override() -> None:
    from zerodram.runtime.topology.placement import build_layout

    p = expert_layout(8, 4)
    assert p.expert_to_rank == (0, 0, 1, 1, 2, 2, 3, 3)
    assert p.local_experts(3) == (6, 7)
    assert expert_layout(5, 2).expert_to_rank == (0, 0, 0, 1, 1)  # the first E % W ranks one more
    assert expert_layout(2, 4).local_experts(3) == ()  # more ranks than experts
    # expert 2 has a replica on rank 0
    placed = build_layout(4, 2, "explicit", explicit_map={0: [1, 3], 1: [0, 2]}, replicas={2: [0]})
    topo = SimpleNamespace(experts=placed)
    assert expert_layout(4, 2, topo) is placed
    assert placed.local_experts(0) == (1, 2, 3) and placed.local_experts(1) == (0, 2)
    assert expert_layout(8, 2, topo).local_experts(0) == (0, 1, 2, 3)  # counts differ: contiguous
    with pytest.raises(ConfigError, match="the topology places 4 experts over 2 ranks, the job has 4"):
        expert_layout(4, 4, topo)


def test_random_weights_do_not_depend_on_placement() -> None:
    cfg = named_config("tiny-moe")
    one = random_weights(cfg, None, 0, dtype=torch.float32)
    p = expert_layout(cfg.num_experts, 4)
    shard = random_weights(cfg, p, 2, dtype=torch.float32)
    assert shard["layers.1.experts.ids"].tolist() == [4, 5]
    torch.testing.assert_close(shard["layers.1.experts.gate"], one["layers.1.experts.gate"][4:6])
    torch.testing.assert_close(shard["layers.0.q"], one["layers.0.q"])


def test_random_dense_slices_cut_the_dense_ffn() -> None:
    """A dense config served as n slices draws the dense FFN and cuts it, so every slicing (and the
    dense model) computes one function: a 1-rank and a 2-rank engine of random:smollm2-135m agree."""
    dense = named_config("tiny-dense")
    want = random_weights(dense, None, 0, dtype=torch.float32)
    for n in (1, 2, 4):
        cfg = dense.as_dense_moe(n)
        p = expert_layout(n, 2) if n > 1 else None
        shards = [random_weights(cfg, p, r, dtype=torch.float32) for r in ((0, 1) if p else (0,))]
        for i in range(dense.num_layers):
            pre = f"layers.{i}."
            for name, dim in (("gate", 0), ("up", 0), ("down", 1)):
                got = torch.cat([e for w in shards for e in w[pre + "experts." + name]], dim)
                torch.testing.assert_close(got, want[pre + "ffn." + name], rtol=0, atol=0)


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    path = tmp_path_factory.mktemp("mix")
    transformers.MixtralForCausalLM(cfg).save_pretrained(path)
    return path


def test_each_rank_reads_only_its_experts(tiny_mixtral: Path) -> None:
    src = SafetensorsDir(tiny_mixtral)
    cfg = ModelConfig.from_hf_dict(src.config_dict())
    full = load_model_weights(src, cfg, None, 0)
    place = expert_layout(4, 2)
    reads: list[str] = []
    orig = src.read
    src.read = lambda name, *a: reads.append(name) or orig(name, *a)  # type: ignore[method-assign]
    w1 = load_model_weights(src, cfg, place, 1)
    assert w1["layers.0.experts.ids"].tolist() == [2, 3]
    torch.testing.assert_close(w1["layers.0.experts.down"], full["layers.0.experts.down"][2:])
    experts_read = {n.split(".experts.")[1].split(".")[0] for n in reads if ".experts." in n}
    assert experts_read == {"2", "3"}
    # a dense checkpoint sliced into experts reads row / column slices of its FFN
    dense = cfg.__class__(
        **{**cfg.__dict__, "num_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0}
    )
    assert dense.as_dense_moe(4).moe_intermediate_size == 6


def test_model_spec_parsing(tmp_path: Path) -> None:
    assert ModelSpec.parse("random:seed-700b").kind == "random"
    with pytest.raises(ConfigError, match="neither"):
        ModelSpec.parse(str(tmp_path / "missing"))
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ConfigError, match=r"config\.json"):
        SafetensorsDir(tmp_path / "ckpt")


def _packaged() -> Path:
    try:
        return ModelSpec.parse("smollm2").path
    except ConfigError as err:
        pytest.skip(str(err))


def test_gguf_tensors_match_transformers_reading(tmp_path: Path) -> None:
    """Our q/k un-permutation and dequantization equal transformers' GGUF loader's."""
    pytest.importorskip("transformers")
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor  # noqa: F401 (presence)

    from zerodram.runtime.loading.gguf_file import GGUFFile

    g = GGUFFile(_packaged())
    cfg = ModelConfig.from_hf_dict(g.config_dict())
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings) == (
        576,
        30,
        9,
        3,
        True,
    )
    raw = {t.name: t for t in g.reader.tensors}
    for ours, theirs, heads in (("q_proj", "attn_q", 9), ("k_proj", "attn_k", 3)):
        t = raw[f"blk.3.{theirs}.weight"]
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        # transformers' reverse_permute_weights
        dim = w.shape[0] // heads // 2
        want = w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
        torch.testing.assert_close(g.read(f"model.layers.3.self_attn.{ours}.weight"), want)


def test_packaged_tokenizer_matches_transformers_ids() -> None:
    from zerodram.runtime.loading.checkpoint import checkpoint_dir
    from zerodram.runtime.loading.tokenizer import Tokenizer

    tok = Tokenizer(checkpoint_dir(ModelSpec.parse("smollm2")) if _packaged() else None)
    ids = tok.apply_chat([{"role": "user", "content": "What is the capital of France?"}])
    # transformers 5.24, AutoTokenizer.from_pretrained(gguf_file=...).apply_chat_template(...)
    assert ids == [
        1,
        9690,
        198,
        2683,
        359,
        253,
        5356,
        5646,
        11173,
        3365,
        3511,
        308,
        34519,
        28,
        7018,
        411,
        407,
        19712,
        8182,
        2,
        198,
        1,
        4093,
        198,
        1780,
        314,
        260,
        3575,
        282,
        4649,
        47,
        2,
        198,
        1,
        520,
        9531,
        198,
    ]
    text = "Hello world!  The  quick\n\nbrown fox 2024 ... don't 🎉"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids == (2,)


def _write_gguf(kind: str, ckpt: Path, path: Path) -> None:
    """A tiny checkpoint as llama.cpp's converter lays its GGUF out: Mixtral as the llama
    architecture with q/k rows permuted for its RoPE, Qwen-MoE as qwen2moe / qwen3moe (no
    permutation, q/k biases or norms, a gated shared expert); experts stacked per layer
    (`ffn_*_exps`), F32 tensors, a gpt2 vocabulary of placeholder tokens (the test feeds ids)."""
    import json

    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((ckpt / "config.json").read_text())
    w = {k: v.float().numpy() for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    H, Hkv, L = (cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "num_hidden_layers"))
    arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[kind]
    E = cfg.get("num_experts") or cfg["num_local_experts"]
    rope = cfg["rope_parameters"]

    def permute(x, heads):  # llama.cpp's convert, llama only: rows (h, 2, pair) -> (h, pair, 2)
        if arch != "llama":
            return x
        return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    out = gguf.GGUFWriter(str(path), arch)
    out.add_block_count(L)
    out.add_context_length(cfg["max_position_embeddings"])
    out.add_embedding_length(cfg["hidden_size"])
    out.add_feed_forward_length(cfg["intermediate_size"])
    out.add_head_count(H)
    out.add_head_count_kv(Hkv)
    if cfg.get("head_dim"):
        out.add_key_length(cfg["head_dim"])
        out.add_value_length(cfg["head_dim"])
    out.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    out.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "yarn":
        out.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        out.add_rope_scaling_factor(rope["factor"])
        out.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    out.add_expert_count(E)
    out.add_expert_used_count(cfg["num_experts_per_tok"])
    if kind != "mixtral":
        out.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        out.add_expert_weights_norm(cfg["norm_topk_prob"])
    if cfg.get("shared_expert_intermediate_size"):
        out.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    out.add_tokenizer_model("gpt2")
    out.add_token_list([f"<t{i}>" for i in range(cfg["vocab_size"])])
    out.add_token_types([1] * cfg["vocab_size"])
    for key, add in (("bos_token_id", out.add_bos_token_id), ("eos_token_id", out.add_eos_token_id)):
        if cfg.get(key) is not None:
            add(cfg[key])
    out.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    out.add_tensor("output.weight", w["lm_head.weight"])
    out.add_tensor("output_norm.weight", w["model.norm.weight"])
    for i in range(L):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add = {
            "attn_norm.weight": w[p + "input_layernorm.weight"],
            "ffn_norm.weight": w[p + "post_attention_layernorm.weight"],
            "attn_q.weight": permute(w[p + "self_attn.q_proj.weight"], H),
            "attn_k.weight": permute(w[p + "self_attn.k_proj.weight"], Hkv),
            "attn_v.weight": w[p + "self_attn.v_proj.weight"],
            "attn_output.weight": w[p + "self_attn.o_proj.weight"],
        }
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
            if p + f"self_attn.{theirs}.bias" in w:
                add[f"{ours}.bias"] = w[p + f"self_attn.{theirs}.bias"]
        for ours in ("q_norm", "k_norm"):
            if p + f"self_attn.{ours}.weight" in w:
                add[f"attn_{ours}.weight"] = w[p + f"self_attn.{ours}.weight"]
        if kind == "mixtral":
            moe, names = p + "block_sparse_moe.", {"gate": "w1", "up": "w3", "down": "w2"}
        else:
            moe, names = p + "mlp.", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
        add["ffn_gate_inp.weight"] = w[moe + "gate.weight"]
        for part, theirs in names.items():  # [E, out, in]
            add[f"ffn_{part}_exps.weight"] = np.stack(
                [w[f"{moe}experts.{e}.{theirs}.weight"] for e in range(E)]
            )
        if moe + "shared_expert_gate.weight" in w:
            add["ffn_gate_inp_shexp.weight"] = w[moe + "shared_expert_gate.weight"][0]  # llama.cpp: [D]
            for part in ("gate", "up", "down"):
                add[f"ffn_{part}_shexp.weight"] = w[f"{moe}shared_expert.{part}_proj.weight"]
        for name, tensor in add.items():
            out.add_tensor(b + name, tensor)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_gguf_files_match_transformers(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MoE GGUF files as llama.cpp writes them (stacked experts; Mixtral's permuted q/k; Qwen's
    biases, q/k norms, shared expert, YaRN metadata) served by the engine in one process give
    transformers' greedy tokens for the same weights."""
    pytest.importorskip("transformers")
    from test_engine_parity import tiny_references
    from test_engine_support import MAX_TOKENS, PROMPTS, engine_greedy

    monkeypatch.setenv("ZERODRAM_CACHE_DIR", str(tmp_path / "cache"))
    ckpts, want = tiny_references(tmp_path / "tiny")
    gguf_path = tmp_path / f"tiny-{kind}.gguf"
    _write_gguf(kind, ckpts[kind], gguf_path)
    assert engine_greedy(str(gguf_path), None, PROMPTS, MAX_TOKENS) == want[kind]


def test_qwen_gguf_vocabulary_splits_as_transformers_does(tmp_path: Path) -> None:
    """A GGUF `gpt2` vocabulary with `tokenizer.ggml.pre = qwen2` (Qwen2/3 files) splits digits one
    by one and handles contractions and newlines as Qwen's tokenizer does: ids equal transformers'
    own GGUF tokenizer's. The merge "1 2" would fire under GPT-2's split, never under Qwen's."""
    pytest.importorskip("transformers")
    import gguf
    import transformers
    from tokenizers import Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from zerodram.runtime.loading.gguf_file import gguf_tokenizer_json

    path = tmp_path / "tok.gguf"
    merges = ["Ġ t", "h e", "Ġt he", "1 2"]
    tokens = [*bytes_to_unicode().values(), "Ġt", "he", "Ġthe", "12", "<|endoftext|>"]
    out = gguf.GGUFWriter(str(path), "qwen2")
    out.add_block_count(1)
    out.add_context_length(64)
    out.add_embedding_length(8)
    out.add_feed_forward_length(8)
    out.add_head_count(1)
    out.add_tokenizer_model("gpt2")
    out.add_tokenizer_pre("qwen2")
    out.add_token_list(tokens)
    out.add_token_merges(merges)
    out.add_token_types([1] * (len(tokens) - 1) + [3])
    out.add_eos_token_id(len(tokens) - 1)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = Tokenizer.from_str(gguf_tokenizer_json(gguf.GGUFReader(str(path)), path))
    for text in ("the 12345 they're\n\n  the", "Hello, WORLD's 2024!\r\n x", "café été<|endoftext|>"):
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(
            text, add_special_tokens=False
        )
    assert tokens.index("12") not in ours.encode("12", add_special_tokens=False).ids


def test_random_dense_sliced_configs_follow_the_expert_count() -> None:
    """random:smollm2-135m (its FFN served as 1 expert) is cut again into one expert per rank, or
    into --experts; a real MoE config refuses another expert count."""
    rm = load_for_rank(ModelSpec.parse("random:smollm2-135m"), 1, 2, dtype=torch.bfloat16)
    assert (rm.config.num_experts, rm.config.num_experts_per_tok) == (2, 2)
    assert rm.placement.local_experts(1) == (1,)
    assert load_for_rank(ModelSpec.parse("random:smollm2-135m"), 0, 1, num_experts=3).config.num_experts == 3
    with pytest.raises(ConfigError, match="slices dense models only"):
        load_for_rank(ModelSpec.parse("random:tiny-moe"), 0, 1, num_experts=3)


def _tiny_dir(
    path: Path, cfg: dict | None = None, edit: Callable[[dict], object] | None = None, experts: int = 0
) -> Path:
    """A tiny Llama checkpoint dir (V 64, D 32, 4 heads of 8, 2 kv heads, FFN 48, 2 layers), or a
    Mixtral one with `experts` experts of width 48; `cfg` overrides config.json's fields and `edit`
    changes the tensors (a dict by name) before they are saved."""
    from safetensors.torch import save_file

    V, D, F, L = 64, 32, 48, 2
    base = {
        "model_type": "mixtral" if experts else "llama",
        "vocab_size": V,
        "hidden_size": D,
        "num_hidden_layers": L,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": F,
        "tie_word_embeddings": False,
    }
    if experts:
        base.update(num_local_experts=experts, num_experts_per_tok=2)
    gen = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(L):
        c = f"model.layers.{i}."
        t |= {c + "input_layernorm.weight": (D,), c + "post_attention_layernorm.weight": (D,)}
        t |= {c + f"self_attn.{n}_proj.weight": (16 if n in "kv" else 32, D) for n in "qkv"}
        t[c + "self_attn.o_proj.weight"] = (D, 32)
        if experts:
            t[c + "block_sparse_moe.gate.weight"] = (experts, D)
            for e in range(experts):
                x = f"{c}block_sparse_moe.experts.{e}."
                t |= {x + "w1.weight": (F, D), x + "w3.weight": (F, D), x + "w2.weight": (D, F)}
        else:
            t |= {c + "mlp.gate_proj.weight": (F, D), c + "mlp.up_proj.weight": (F, D)}
            t[c + "mlp.down_proj.weight"] = (D, F)
    tensors = {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in t.items()}
    if edit is not None:
        edit(tensors)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**base, **(cfg or {})}))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_tiny_checkpoint_loads_dense_and_sliced(tmp_path: Path) -> None:
    """The unedited tiny checkpoints load (so the refusals below are the edits'); --experts 4 cuts
    the dense FFN of 48 into 4 experts of 12."""
    assert load_for_rank(ModelSpec.parse(str(_tiny_dir(tmp_path / "d"))), 0, 1).config.num_experts == 0
    sliced = load_for_rank(ModelSpec.parse(str(tmp_path / "d")), 0, 1, num_experts=4)
    assert sliced.weights["layers.1.experts.gate"].shape == (4, 12, 32)
    moe = load_for_rank(ModelSpec.parse(str(_tiny_dir(tmp_path / "m", experts=4))), 0, 1, num_experts=4)
    assert moe.weights["layers.0.experts.down"].shape == (4, 32, 48)


L0 = "model.layers.0."


@pytest.mark.parametrize(
    ("cfg", "edit", "experts", "match"),
    [
        # quantized weights: the config's quantization_config, or tensors that are not floats
        ({"quantization_config": {"quant_method": "fp8"}}, None, 0, "quant_method 'fp8'"),
        (
            None,
            lambda t: t.update({L0 + "mlp.up_proj.weight": torch.zeros(48, 32, dtype=torch.int8)}),
            0,
            "I8",
        ),
        (
            None,
            lambda t: t.update({"lm_head.weight": t["lm_head.weight"].to(torch.float8_e4m3fn)}),
            0,
            "F8_E4M3",
        ),
        # shapes the config does not imply
        (
            None,
            lambda t: t.update({L0 + "self_attn.q_proj.weight": torch.zeros(16, 32)}),
            0,
            r"\[16, 32\].*\[32, 32\]",
        ),
        (
            None,
            lambda t: t.update({"model.norm.weight": torch.ones(1)}),
            0,
            r"'model.norm.weight' has shape \[1\]",
        ),
        (None, lambda t: t.update({"lm_head.weight": torch.zeros(80, 32)}), 0, r"\[80, 32\].*\[64, 32\]"),
        (None, lambda t: t.update({L0 + "mlp.down_proj.weight": torch.zeros(32, 64)}), 0, r"\[D, F\]"),
        ({"num_local_experts": 2}, None, 4, r"gate.weight' has shape \[4, 32\].*\[2, 32\]"),
        (None, lambda t: t.update({L0 + "block_sparse_moe.gate.weight": torch.zeros(32, 4)}), 4, r"\[E, D\]"),
        (
            None,
            lambda t: t.update({L0 + "block_sparse_moe.experts.2.w1.weight": torch.zeros(30, 32)}),
            4,
            "M, D",
        ),
        (
            None,
            lambda t: t.update({L0 + "block_sparse_moe.experts.4.w1.weight": torch.zeros(48, 32)}),
            4,
            "4 experts",
        ),
        # silent fallbacks: an untied head that is missing, biases the model would not apply
        (None, lambda t: t.pop("lm_head.weight"), 0, "no tensor 'lm_head.weight'"),
        (
            None,
            lambda t: t.update({L0 + "self_attn.q_proj.bias": torch.zeros(32)}),
            0,
            "bias the config does not use",
        ),
        ({"mlp_bias": True}, None, 0, "mlp_bias"),
        ({"attention_bias": True}, None, 0, "attention_bias"),
    ],
)
def test_checkpoints_the_config_does_not_describe_are_refused(
    tmp_path: Path, cfg: dict | None, edit: Callable | None, experts: int, match: str
) -> None:
    path = _tiny_dir(tmp_path / "ckpt", cfg, edit, experts)
    with pytest.raises(ConfigError, match=match) as err:
        load_for_rank(ModelSpec.parse(str(path)), 0, 1)
    assert str(path) in str(err.value)


def test_unreadable_checkpoint_files_are_refused_by_name(tmp_path: Path) -> None:
    path = _tiny_dir(tmp_path / "ckpt")
    shard = path / "model.safetensors"
    whole = shard.read_bytes()
    for broken in (b"", b"\x13" * 64, whole[: len(whole) // 2]):  # empty, random, truncated
        shard.write_bytes(broken)
        with pytest.raises(ConfigError, match="not a readable safetensors file") as err:
            SafetensorsDir(path)
        assert str(shard) in str(err.value)
    shard.write_bytes(whole)
    (path / "zz-stale.safetensors").write_bytes(whole)  # every tensor in two shards: which is right?
    with pytest.raises(ConfigError, match=r"in two shards: model\.safetensors and zz-stale\.safetensors"):
        SafetensorsDir(path)
    (path / "zz-stale.safetensors").unlink()
    for text, match in (
        ("{", r"config\.json:1:2: not valid JSON"),
        ("[1, 2]", r"config\.json: must be a JSON object"),
    ):
        (path / "config.json").write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_for_rank(ModelSpec.parse(str(path)), 0, 1)


def test_experts_option_is_refused_where_it_cannot_apply(tmp_path: Path) -> None:
    """--experts slices a dense FFN: refused for a Hugging Face MoE dir (as for random:tiny-moe) and
    for a width that does not divide (48 into 5)."""
    moe = _tiny_dir(tmp_path / "moe", experts=4)
    with pytest.raises(ConfigError, match="has 4 experts; --experts slices dense models only"):
        load_for_rank(ModelSpec.parse(str(moe)), 0, 1, num_experts=2)
    dense = _tiny_dir(tmp_path / "dense")
    with pytest.raises(ConfigError, match="intermediate_size=48 does not split into 5 experts") as err:
        load_for_rank(ModelSpec.parse(str(dense)), 0, 1, num_experts=5)
    assert str(dense) in str(err.value)


def test_broken_gguf_files_are_refused_by_name(tmp_path: Path) -> None:
    """A GGUF cut short anywhere, or without a required header field, is refused naming the file."""
    import gguf

    from zerodram.runtime.loading.gguf_file import GGUFFile

    def write(path: Path, heads: bool) -> bytes:
        out = gguf.GGUFWriter(str(path), "llama")
        out.add_block_count(1)
        out.add_embedding_length(8)
        if heads:
            out.add_head_count(2)
        out.add_token_list([f"<t{i}>" for i in range(16)])
        out.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
        out.write_header_to_file()
        out.write_kv_data_to_file()
        out.write_tensors_to_file()
        out.close()
        return path.read_bytes()

    path = tmp_path / "tiny.gguf"
    whole = write(path, heads=True)
    for size in range(0, len(whole), 37):
        path.write_bytes(whole[:size])
        with pytest.raises(ConfigError, match=r"tiny\.gguf"):
            GGUFFile(path)
    write(path, heads=False)
    with pytest.raises(ConfigError, match=r"tiny\.gguf: GGUF header has no 'llama.attention.head_count'"):
        GGUFFile(path)
