import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_sdk.errors import WireFormatError
from afd_sdk.wire import (
    ControlPayload,
    F2APayload,
    Goodbye,
    Hello,
    ModelFingerprint,
    TensorHeader,
    TensorSpec,
    TransferMetadata,
    decode_control,
    decode_header,
    dtype_from_name,
    dtype_to_name,
    encode_control,
    encode_header,
)


def test_transfer_metadata_validation():
    md = TransferMetadata(3, 1, (4, 0, 2))
    assert md.num_tokens == 6
    for bad in [(-1, 0, (1,)), (0, -1, (1,)), (0, 0, ()), (0, 0, (1, -2))]:
        with pytest.raises(WireFormatError):
            TransferMetadata(*bad)


def test_control_round_trip_all_messages():
    fp = ModelFingerprint("Qwen3MoeForCausalLM", 64, "float32", 2, "qwen", "0.1")
    msgs = [
        ControlPayload(7, ((3, 4), (0, 1)), 4, 2, is_warmup=True),
        Hello(1, "attention", 0, 2, 1, "ZmqAFDConnector", fp, 2),
        Goodbye(),
    ]
    for m in msgs:
        assert decode_control(encode_control(m)) == m
    assert ControlPayload(0, ((1,),), 1, 1).num_stages == 1


def test_control_payload_validation_on_decode():
    raw = msgspec.msgpack.encode(
        {"type": "control", "step_idx": 0, "stage_token_counts": [[-1]], "max_num_tokens": 1, "num_layers": 1}
    )
    with pytest.raises(WireFormatError):
        decode_control(raw)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_malformed_control_bytes_only_wireformaterror(data):
    try:
        decode_control(data)
    except WireFormatError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_malformed_header_bytes_only_wireformaterror(data):
    try:
        decode_header(data)
    except WireFormatError:
        pass


def test_header_round_trip():
    h = TensorHeader("a2f", 2, 0, (5,), (TensorSpec("hidden_states", "bfloat16", (5, 8)),))
    assert decode_header(encode_header(h)) == h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int32, torch.int64])
def test_dtype_names(dtype):
    assert dtype_from_name(dtype_to_name(dtype)) is dtype


def test_dtype_allow_list():
    with pytest.raises(WireFormatError, match="expected one of"):
        dtype_from_name("complex64")
    with pytest.raises(WireFormatError):
        dtype_from_name("__class__")


def test_f2a_combined():
    r, s = torch.ones(2, 3), torch.full((2, 3), 2.0)
    assert torch.equal(F2APayload(r, s).combined(), torch.full((2, 3), 3.0))
    assert F2APayload(r).combined() is r


def test_no_pickle_in_project():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    offenders = [
        str(p.relative_to(root))
        for d in ("afd_sdk", "connectors", "models")
        for p in (root / d).rglob("*.py")
        if "import pickle" in p.read_text() or "pickle.loads" in p.read_text()
    ]
    assert offenders == []
