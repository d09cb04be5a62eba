import json

import pytest

from afd_sdk.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plugins_json(capsys, fresh_plugins):
    code, out, _ = run(capsys, "plugins", "--json")
    assert code == 0
    data = json.loads(out)
    names = {c["name"] for c in data["connectors"]}
    assert {"ZmqAFDConnector", "P2pNcclAFDConnector"} <= names
    assert any(p["name"] == "afd_connectors.plugin" and p["distribution"] == "afd-sdk" for p in data["plugins"])


def test_plugins_table(capsys, fresh_plugins):
    code, out, _ = run(capsys, "plugins")
    assert code == 0 and "afd-sdk plugins" in out


def test_plugins_show_connector_aliases(capsys, fresh_plugins):
    code, out, _ = run(capsys, "plugins", "--json")
    zmq = next(c for c in json.loads(out)["connectors"] if c["name"] == "ZmqAFDConnector")
    assert code == 0 and zmq["aliases"] == ["zmq"]
    code, out, _ = run(capsys, "plugins")
    assert code == 0 and "(zmq)" in out.replace("\n", " ")


def test_config_check_envelope_and_json(capsys, fresh_plugins, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"afd": {"afd_role": "ffn", "afd_connector": "p2p"}}))
    code, out, _ = run(capsys, "config", "check", str(path), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["afd"]["role"] == "ffn" and data["afd"]["connector"] == "p2p"
    assert data["connector_class"].endswith(":P2pNcclAFDConnector")
    assert data["connector_extra_config"] == {"backend": "auto", "store_port": None, "wire": "auto"}


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["config", "check", '{"role": "ffn", "prot": 1}'], "afd.prot is not a known key; did you mean 'port'?"),
        (
            ["config", "check", '{"role": "ffn", "connector": "zmqq"}'],
            "connector 'zmqq' is not registered; did you mean 'zmq'?",
        ),
        (
            ["topology", "--connector", "p2p", "--attention", "1", "--ffn", "2"],
            "num_attention_ranks=1 < num_ffn_ranks=2",
        ),
        (["topology", "--connector", "p2p", "--attention", "x", "--ffn", "2"], "'x' is not a valid integer"),
        (["nosuchcommand"], "No such command"),
    ],
)
def test_invalid_input_exit_2_one_line(capsys, fresh_plugins, argv, needle):
    code, _out, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("error: ") and needle in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_topology_json(capsys, fresh_plugins):
    code, out, _ = run(capsys, "topology", "--connector", "p2p", "--attention", "5", "--ffn", "2", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["layout"] == "ffn_first" and data["world_size"] == 7
    assert data["ranks"][0]["peers"] == [0, 1, 2] and data["ranks"][1]["peers"] == [3, 4]


def test_topology_table(capsys, fresh_plugins):
    code, out, _ = run(capsys, "topology", "--connector", "zmq", "--attention", "3", "--ffn", "2")
    assert code == 0 and "3A2F" in out


def test_topology_json_shows_redundant_expert_placement(capsys, fresh_plugins):
    argv = ["topology", "--connector", "cam", "--attention", "1", "--ffn", "4", "--experts", "8", "--json"]
    code, out, _ = run(capsys, *argv, "--expert-replicas", "2")
    assert code == 0
    data = json.loads(out)
    assert data["expert_replicas"] == 2
    ffn = [r for r in data["ranks"] if r["role"] == "ffn"]
    assert [r["experts"] for r in ffn] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2
    assert [r["primary_experts"] for r in ffn] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    code, _, err = run(capsys, *argv, "--expert-replicas", "3")
    assert code == 2 and "expert_replicas=3 does not divide num_ffn_ranks=4" in err
