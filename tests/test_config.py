import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_sdk.config import AFDConfig, parse_config, parse_extra_config
from afd_sdk.errors import AFDConfigError


def test_defaults_and_canonical_keys():
    cfg = parse_config({"role": "ffn"})
    assert cfg == AFDConfig(role="ffn")
    assert cfg.timeout_s == 60.0 and cfg.num_stages == 1 and cfg.connector_extra_config == {}


def test_upstream_aliases_normalise():
    cfg = parse_config(
        {"afd_role": "attention", "afd_connector": "p2p", "afd_host": "10.0.0.2", "afd_port": "4000", "async": "true"}
    )
    assert (cfg.role, cfg.connector, cfg.host, cfg.port, cfg.async_dp) == ("attention", "p2p", "10.0.0.2", 4000, True)


def test_alias_and_canonical_together_rejected():
    with pytest.raises(AFDConfigError, match=r"afd\.role and afd\.afd_role both set 'role'"):
        parse_config({"role": "ffn", "afd_role": "ffn"})


def test_unknown_key_did_you_mean():
    with pytest.raises(
        AFDConfigError, match=r"afd\.num_ffn_rank is not a known key; did you mean 'num_ffn_ranks'\?"
    ) as ei:
        parse_config({"role": "ffn", "num_ffn_rank": 2})
    assert ei.value.key == "afd.num_ffn_rank" and ei.value.value == 2


@pytest.mark.parametrize(
    ("raw", "field", "expected"),
    [
        ({"compute_gate_on_attention": "yes"}, "compute_gate_on_attention", True),
        ({"compute_gate_on_attention": "0"}, "compute_gate_on_attention", False),
        ({"async_dp": 1}, "async_dp", True),
        ({"port": "29999"}, "port", 29999),
        ({"num_stages": 2.0}, "num_stages", 2),
        ({"timeout_s": "2.5"}, "timeout_s", 2.5),
        ({"connect_timeout_s": 600}, "connect_timeout_s", 600.0),
        ({"role": " FFN "}, "role", "ffn"),
    ],
)
def test_string_and_number_normalisation(raw, field, expected):
    assert getattr(parse_config({"role": "ffn", **raw}), field) == expected


@pytest.mark.parametrize(
    ("raw", "key", "accepted"),
    [
        ({"role": "router"}, "afd.role", "one of 'attention', 'ffn'"),
        ({"port": 0}, "afd.port", r"an integer in \[1, 65535\]"),
        ({"port": True}, "afd.port", "an integer"),
        ({"num_stages": 0}, "afd.num_stages", r"\[1, 64\]"),
        ({"timeout_s": -1}, "afd.timeout_s", "seconds"),
        ({"timeout_s": "nan"}, "afd.timeout_s", "seconds"),
        ({"connect_timeout_s": 0}, "afd.connect_timeout_s", "seconds"),
        ({"async_dp": "maybe"}, "afd.async_dp", "a bool"),
        ({"host": "bad host!"}, "afd.host", "IP address or host name"),
        ({"connector_extra_config": [1]}, "afd.connector_extra_config", "JSON object"),
        ({"connector": ""}, "afd.connector", "registered connector name"),
    ],
)
def test_invalid_values_name_key_value_and_accepted(raw, key, accepted):
    with pytest.raises(AFDConfigError, match=accepted) as ei:
        parse_config({"role": "ffn", **raw})
    assert ei.value.key == key
    assert key in str(ei.value)


def test_role_required():
    with pytest.raises(AFDConfigError, match="afd.role is required"):
        parse_config({})


def test_inputs_json_string_file_envelope_and_vllm_object(tmp_path):
    body = {"role": "attention", "afd_port": 1234}
    assert parse_config(json.dumps(body)).port == 1234
    assert parse_config({"afd": body}).port == 1234
    path = tmp_path / "afd.json"
    path.write_text(json.dumps({"afd": body}))
    assert parse_config(str(path)).port == 1234
    assert parse_config(path).port == 1234

    class FakeVllmConfig:
        additional_config = {"afd": body}

    assert parse_config(FakeVllmConfig()).role == "attention"


@pytest.mark.parametrize("bad", ["{not json", "/no/such/file.json", "[1, 2]", 42, {"afd": 3}])
def test_bad_inputs(bad):
    with pytest.raises(AFDConfigError):
        parse_config(bad)


def test_extra_config_string_json_is_parsed():
    assert parse_config({"role": "ffn", "connector_extra_config": '{"transport": "ipc"}'}).connector_extra_config == {
        "transport": "ipc"
    }


def test_replace_revalidates():
    cfg = parse_config({"role": "ffn"})
    assert cfg.replace(port=5555).port == 5555
    with pytest.raises(AFDConfigError):
        cfg.replace(port=-1)


class _Schema(msgspec.Struct, forbid_unknown_fields=True):
    depth: int = 4
    fast: bool = False


def test_parse_extra_config_closed_schema():
    assert parse_extra_config(_Schema, {"depth": "8", "fast": "true"}, connector="X") == _Schema(8, True)
    with pytest.raises(
        AFDConfigError, match=r"connector_extra_config\.dept is not accepted by X; did you mean 'depth'"
    ):
        parse_extra_config(_Schema, {"dept": 1}, connector="X")
    with pytest.raises(AFDConfigError, match=r"connector_extra_config\.depth='deep' is invalid for X") as ei:
        parse_extra_config(_Schema, {"depth": "deep"}, connector="X")
    assert ei.value.key == "afd.connector_extra_config.depth"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
keys = st.sampled_from(
    [
        "role",
        "connector",
        "host",
        "port",
        "num_attention_ranks",
        "num_ffn_ranks",
        "compute_gate_on_attention",
        "async_dp",
        "connector_extra_config",
        "timeout_s",
        "num_stages",
        "afd_role",
        "afd_port",
        "async",
        "afd",
        "other",
    ]
) | st.text(max_size=10)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.dictionaries(keys, json_values, max_size=8), json_values, st.text(max_size=40)))
def test_fuzz_only_afdconfigerror(raw):
    try:
        cfg = parse_config(raw)
    except AFDConfigError:
        return
    assert cfg.role in ("attention", "ffn")
    assert parse_config(cfg.to_dict()) == cfg  # normalised output re-parses to itself


def test_ffn_hosts_give_each_ffn_rank_its_address_and_default_host():
    cfg = parse_config({"role": "attention", "num_ffn_ranks": 2, "ffn_hosts": "10.0.0.3, 10.0.0.4"})
    assert cfg.ffn_hosts == ("10.0.0.3", "10.0.0.4") and cfg.host == "10.0.0.3"
    assert [cfg.ffn_host(f) for f in range(2)] == ["10.0.0.3", "10.0.0.4"]
    assert parse_config(json.loads(json.dumps(cfg.to_dict()))) == cfg  # round-trips through JSON
    # an explicit host stays (CAM's store master is attention rank 0, not an FFN rank)
    assert parse_config({"role": "ffn", "host": "10.0.0.1", "ffn_hosts": ["10.0.0.3"]}).host == "10.0.0.1"
    plain = parse_config({"role": "ffn", "host": "10.0.0.9", "num_ffn_ranks": 2})
    assert plain.ffn_hosts is None and plain.ffn_host(1) == "10.0.0.9"


@pytest.mark.parametrize(
    ("raw", "key", "accepted"),
    [
        ({"ffn_hosts": ["10.0.0.3"]}, "afd.ffn_hosts", "one address per FFN rank: 2"),
        ({"ffn_hosts": []}, "afd.ffn_hosts", "non-empty list"),
        ({"ffn_hosts": 7}, "afd.ffn_hosts", "non-empty list"),
        ({"ffn_hosts": ["10.0.0.3", "a b"]}, "afd.ffn_hosts[1]", "IP address or host name"),
    ],
)
def test_bad_ffn_hosts_name_the_entry(raw, key, accepted):
    with pytest.raises(AFDConfigError) as info:
        parse_config({"role": "ffn", "num_ffn_ranks": 2, **raw})
    assert info.value.key == key and accepted in str(info.value), str(info.value)
