import json

import pytest

pytest.importorskip("transformers", reason="building a tiny checkpoint needs the [hf] extra")

from afd_sdk.cli import main
from afd_sdk.integrations.transformers import save_tiny_checkpoint


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    return save_tiny_checkpoint("DeepseekV4ForCausalLM", tmp_path_factory.mktemp("v4"))


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_directory_json(capsys, v4_dir):
    code, out, _ = run(capsys, "weights", "classify", str(v4_dir), "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"architecture", "counts", "bytes", "unclassified", "roles"}
    assert data["architecture"] == "DeepseekV4ForCausalLM" and data["unclassified"] == []
    assert data["roles"]["model.layers.0.ffn_norm.weight"] == "attention"
    assert data["roles"]["model.layers.0.ffn.gate.tid2eid"] == "ffn"
    assert data["counts"]["attention"] + data["counts"]["ffn"] == len(data["roles"])
    assert data["bytes"]["ffn"] > 0


def test_single_file_needs_config(capsys, v4_dir):
    code, _, err = run(capsys, "weights", "classify", str(v4_dir / "model.safetensors"))
    assert code == 2 and "pass --config" in err
    code, out, _ = run(
        capsys,
        "weights",
        "classify",
        str(v4_dir / "model.safetensors"),
        "--config",
        str(v4_dir / "config.json"),
        "--gate-on-attention",
        "--json",
    )
    assert code == 0
    assert json.loads(out)["roles"]["model.layers.1.ffn.gate.weight"] == "both"


def test_names_file_with_unclassified_exits_1(capsys, tmp_path):
    names = tmp_path / "names.txt"
    names.write_text("model.embed_tokens.weight\nmodel.layers.0.mlp.gate.weight\nmodel.layers.0.mystery.weight\n")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2, "num_experts": 4}))
    code, out, _ = run(capsys, "weights", "classify", str(names), "--config", str(cfg))
    assert code == 1
    assert "unclassified: model.layers.0.mystery.weight" in out
    code, out, _ = run(capsys, "weights", "classify", str(names), "--config", str(cfg), "--arch", "Nope", "--json")
    assert code == 2


def test_missing_path_is_usage_error(capsys, tmp_path):
    code, _, err = run(capsys, "weights", "classify", str(tmp_path / "nope"))
    assert code == 2 and err.startswith("error: ")
