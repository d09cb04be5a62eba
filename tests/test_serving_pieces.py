"""The pieces `vllm serve` deployments are built from, checked without vLLM: the tiny tokenizer, the
attention role's `vllm serve` command line, and the FFN server's independent worlds."""

from __future__ import annotations

import json

import pytest

from afd_sdk import parse_config
from afd_sdk.errors import AFDConfigError, PeerLostError
from afd_sdk.integrations.tokenizer import SPECIAL_TOKENS, save_tiny_tokenizer, tiny_vocabulary
from afd_sdk.integrations.vllm.serve import serve_argv
from afd_sdk.runtime.stats import ServeStats
from afd_sdk.runtime.worlds import WorldOutcome, served, world_configs

transformers = pytest.importorskip("transformers", reason="the tokenizer check loads it with transformers")


def test_vocabulary_has_exactly_vocab_size_distinct_tokens():
    for n in (12, 96, 500, 5000):
        vocab = tiny_vocabulary(n)
        assert len(vocab) == n and len(set(vocab)) == n
        assert tuple(vocab[: len(SPECIAL_TOKENS)]) == SPECIAL_TOKENS
    with pytest.raises(AFDConfigError, match="vocab_size=3 is too small"):
        tiny_vocabulary(3)


def test_tokenizer_round_trips_text_and_renders_chat(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 96, "eos_token_id": 7, "bos_token_id": 9}))
    save_tiny_tokenizer(tmp_path, 96)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 96 and tok.eos_token_id == 2 and tok.bos_token_id == 1
    ids = tok("the cat sat on the mat .")["input_ids"]
    assert ids[0] == 1 and 0 not in ids  # <s> first, every word known
    assert tok.decode(ids, skip_special_tokens=True) == "the cat sat on the mat."
    assert tok.decode(tok("hello zebra")["input_ids"][1:]) == "hello <unk>"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hello cat"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|user|> hello cat <|assistant|>"
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # engines stop on the tokenizer's </s>


def test_serve_argv_is_the_llm_settings_as_flags(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    argv = serve_argv(tmp_path, {"connector": "zmq", "port": 29650}, port=8000, max_model_len=128)
    assert argv[:5] == ["vllm", "serve", str(tmp_path), "--port", "8000"]
    assert "--enforce-eager" in argv and "--skip-tokenizer-init" not in " ".join(argv)
    i = argv.index("--additional-config")
    assert json.loads(argv[i + 1]) == {"afd": {"connector": "zmq", "port": 29650, "role": "attention"}}
    assert json.loads(argv[argv.index("--hf-overrides") + 1]) == {"architectures": ["AFDQwen3MoeForCausalLM"]}
    assert argv[argv.index("--shutdown-timeout") + 1] == "10" and argv[argv.index("--max-model-len") + 1] == "128"
    native = serve_argv(tmp_path, None, port=8001)
    assert "--additional-config" not in native and "--hf-overrides" not in native and "--shutdown-timeout" in native
    with pytest.raises(AFDConfigError, match="afd ffn serve --engine vllm"):
        serve_argv(tmp_path, {"role": "ffn"}, port=8000)


def test_world_configs_replace_the_port_and_refuse_repeats():
    cfg = parse_config({"role": "ffn", "port": 29650, "timeout_s": 5})
    assert world_configs(cfg, ()) == [cfg]
    worlds = world_configs(cfg, (29650, 29700))
    assert [w.port for w in worlds] == [29650, 29700] and all(w.timeout_s == 5 for w in worlds)
    with pytest.raises(AFDConfigError, match="repeat a port"):
        world_configs(cfg, (29650, 29650))


def test_served_raises_the_first_world_error():
    ok = WorldOutcome(1, stats=ServeStats(steps=3))
    assert served([ok]) == [ok.stats]
    lost = WorldOutcome(2, error=PeerLostError("peer gone"))
    with pytest.raises(PeerLostError, match="peer gone"):
        served([ok, lost])


@pytest.mark.parametrize(
    ("amx", "machine", "hf", "dtype", "want"),
    [
        (True, "x86_64", {"kv_lora_rank": 16, "qk_rope_head_dim": 8}, "float32", "CPU_MLA"),  # tiny fp32 MLA
        (True, "x86_64", {"kv_lora_rank": 512, "qk_rope_head_dim": 64}, "float32", "CPU_MLA"),  # AMX wants bf16
        (True, "x86_64", {"kv_lora_rank": 512, "qk_rope_head_dim": 64}, "bfloat16", None),  # what AMX_MLA runs
        (False, "x86_64", {"kv_lora_rank": 16, "qk_rope_head_dim": 8}, "float32", None),  # no AMX: vLLM picks CPU_MLA
        (True, "aarch64", {"kv_lora_rank": 16, "qk_rope_head_dim": 8}, "float32", None),
        (True, "x86_64", {"num_attention_heads": 4}, "float32", None),  # not MLA
        (True, "x86_64", {"kv_lora_rank": 16, "model_type": "deepseek_v4"}, "float32", None),  # V4: own kernels
        (True, "x86_64", {"text_config": {"kv_lora_rank": 16, "qk_rope_head_dim": 8}}, "float32", "CPU_MLA"),
    ],
)
def test_cpu_attention_backend_avoids_amx_mla_where_it_cannot_run(monkeypatch, amx, machine, hf, dtype, want):
    import platform

    import torch

    from afd_sdk.integrations.vllm.ffn import cpu_attention_backend

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    assert cpu_attention_backend(hf, dtype) == want
