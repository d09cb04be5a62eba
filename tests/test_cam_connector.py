"""CAMAsyncAFDConnector in-process: config schema, backend choice, Ascend operator calls, model split."""

from __future__ import annotations

import pytest
import torch

from afd_connectors.cam import ascend as cam_ascend
from afd_connectors.cam.connector import CAMAsyncAFDConnector
from afd_sdk.adapter import MoELayout
from afd_sdk.config import parse_config
from afd_sdk.connector import ConnectorContext
from afd_sdk.errors import AFDConfigError, ConnectorError, PeerLostError
from afd_sdk.plugins import get_plugin_manager
from afd_sdk.wire import ModelFingerprint, TransferMetadata

MOE = MoELayout(num_experts=4, top_k=2, moe_layers=(1, 2))
MODEL = ModelFingerprint("Check", 8, "float32", 3)


def config(role: str = "attention", **kw):
    return parse_config(
        {
            "connector": "cam",
            "role": role,
            "compute_gate_on_attention": True,
            "timeout_s": 1.0,
            "connect_timeout_s": 1.0,
            "port": 29999,
            **kw,
        }
    )


def connector(role: str = "attention", rank: int = 0, *, device: str = "cpu", moe=MOE, **kw) -> CAMAsyncAFDConnector:
    cfg = config(role, **kw)
    resolved = get_plugin_manager().resolve_config(cfg)
    return CAMAsyncAFDConnector(ConnectorContext(cfg, rank, MODEL, resolved.extra_config, device=device, moe=moe))


# --- config ------------------------------------------------------------------------


def test_registered_with_alias_and_upstream_extra_schema():
    pm = get_plugin_manager()
    assert pm.connector_class("cam") is CAMAsyncAFDConnector
    extra = CAMAsyncAFDConnector.parse_extra_config(
        {
            "dynamicQuant": 0,
            "attn_ranks_per_dp": 1,
            "async_moe_ubatching": "true",
            "async_moe_num_ubatches": "2",
            "async_moe_split": "request",
        }
    )
    assert extra.async_moe_ubatching is True and extra.async_moe_num_ubatches == 2


@pytest.mark.parametrize(
    ("afd", "key"),
    [
        ({"connector_extra_config": {"dynamicquant": 1}}, "afd.connector_extra_config.dynamicquant"),
        ({"connector_extra_config": {"async_moe_split": "layer"}}, "afd.connector_extra_config.async_moe_split"),
        ({"compute_gate_on_attention": False}, "compute_gate_on_attention"),
        (
            {"num_attention_ranks": 3, "connector_extra_config": {"attn_ranks_per_dp": 2}},
            "afd.connector_extra_config.attn_ranks_per_dp",
        ),
        ({"num_stages": 2}, "num_stages"),
        ({"num_stages": 3, "connector_extra_config": {"async_moe_ubatching": True}}, "num_stages"),
        (
            {"connector_extra_config": {"async_moe_ubatching": True, "async_moe_num_ubatches": 1}},
            "afd.connector_extra_config.async_moe_num_ubatches",
        ),
        (
            {"num_ffn_ranks": 3, "connector_extra_config": {"expert_replicas": 2}},
            "afd.connector_extra_config.expert_replicas",
        ),
        ({"connector_extra_config": {"expert_replicas": 0}}, "afd.connector_extra_config.expert_replicas"),
        (
            {
                "num_ffn_ranks": 2,
                "num_stages": 2,
                "connector_extra_config": {"expert_replicas": 2, "async_moe_ubatching": True},
            },
            "afd.connector_extra_config.expert_replicas",
        ),
    ],
)
def test_config_rejections_name_the_key(afd, key):
    with pytest.raises(AFDConfigError) as ei:
        get_plugin_manager().resolve_config(config(**afd))
    assert ei.value.key == key, str(ei.value)


def test_ubatching_accepts_matching_stages():
    cfg = config(num_stages=2, connector_extra_config={"async_moe_ubatching": True, "async_moe_num_ubatches": 2})
    get_plugin_manager().resolve_config(cfg)


def test_stage_extra_config_is_what_the_validation_asks_for():
    assert CAMAsyncAFDConnector.stage_extra_config(1) == {}
    for stages in (2, 3):
        get_plugin_manager().resolve_config(
            config(num_stages=stages, connector_extra_config=CAMAsyncAFDConnector.stage_extra_config(stages))
        )


# --- backend choice (before resources) ------------------------------------------------


def test_auto_picks_portable_on_cpu():
    assert connector().backend_name == "portable"


def test_ascend_requested_without_torch_npu_says_what_is_missing():
    assert cam_ascend.ascend_missing() is not None  # this machine has no CANN
    with pytest.raises(AFDConfigError, match="torch_npu") as ei:
        connector(connector_extra_config={"backend": "ascend"})
    assert ei.value.key == "afd.connector_extra_config.backend"


def test_portable_rejects_dynamic_quant_and_npu_tensors():
    with pytest.raises(AFDConfigError, match="dynamicQuant"):
        connector(connector_extra_config={"dynamicQuant": 1})
    with pytest.raises(AFDConfigError, match="npu"):
        connector(device="npu", connector_extra_config={"backend": "portable"})


def test_needs_a_moe_layout_and_enough_experts():
    with pytest.raises(AFDConfigError, match="MoELayout"):
        connector(moe=None)
    with pytest.raises(Exception, match="num_experts=2 < num_ffn_ranks=3"):
        connector(moe=MoELayout(2, 1, (0,)), num_ffn_ranks=3)


def test_init_without_peers_fails_within_timeout_and_close_is_idempotent():
    conn = connector(num_ffn_ranks=1)  # attention rank 0 hosts the store and waits for the FFN rank
    with pytest.raises(PeerLostError, match="TCPStore rendezvous"):
        conn.init()
    conn.close()
    conn.close()
    assert not conn.is_initialized


def test_data_path_checks_before_any_transfer():
    conn = connector()
    conn._initialized = True  # argument checks run before the backend is touched
    x = torch.zeros(3, 8)
    md = TransferMetadata(1, 0, (3,))
    with pytest.raises(ConnectorError, match="topk_ids and topk_weights"):
        conn.send_attn_output(x, md)
    with pytest.raises(ConnectorError, match=r"expected \[3, 2\]"):
        conn.send_attn_output(x, md, topk_ids=torch.zeros(3, 1, dtype=torch.long), topk_weights=torch.zeros(3, 1))
    with pytest.raises(ConnectorError, match="outside"):
        conn.send_attn_output(x, md, topk_ids=torch.full((3, 2), 9), topk_weights=torch.zeros(3, 2))
    with pytest.raises(ConnectorError, match="without a preceding send"):
        conn.recv_ffn_output(x, 0)
    with pytest.raises(ConnectorError, match="ffn-side"):
        conn.recv_ffn_work_item(0)


# --- the Ascend backend's operator calls ---------------------------------------------------


class _RecordingOps:
    """Stands in for torch.ops.umdk_cam_op_lib: records each call's positional arguments."""

    def __init__(self, hidden: int) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.hidden = hidden

    def __getattr__(self, name):
        if name not in cam_ascend.CAM_OPS:
            raise AttributeError(name)

        def op(*args):
            self.calls.append((name, args))
            if name == "async_combine_recv":
                return torch.ones(args[5], self.hidden)
            if name == "async_dispatch_recv":
                group_list = torch.tensor([2, 1])
                token_nums = torch.tensor([3, 4, 2])  # total tokens, rank id, layer index
                return torch.ones(8, self.hidden), None, None, None, token_nums, group_list, torch.tensor([0])
            return None

        return op


@pytest.fixture
def fake_ascend(monkeypatch):
    ops = _RecordingOps(MODEL.hidden_size)
    monkeypatch.setattr(cam_ascend, "ascend_missing", lambda: None)
    monkeypatch.setattr(cam_ascend, "_cam_ops", lambda: ops)
    monkeypatch.setattr(cam_ascend, "open_store", lambda conn, ns: object())
    monkeypatch.setattr(cam_ascend.AscendCamBackend, "_hccl_group", lambda self, store, rank: (object(), "hcom_7"))
    return ops


def test_ascend_backend_calls_the_cam_operators_in_upstream_order(fake_ascend):
    extra = {"backend": "ascend", "attn_ranks_per_dp": 2, "dynamicQuant": 1}
    attn = connector("attention", 1, num_attention_ranks=2, num_ffn_ranks=2, connector_extra_config=extra)
    attn.init()
    x, ids, w = torch.zeros(3, 8), torch.tensor([[0, 3], [1, 2], [3, 0]]), torch.rand(3, 2)
    attn.send_attn_output(x, TransferMetadata(2, 0, (3,)), topk_ids=ids, topk_weights=w)
    out = attn.recv_ffn_output(x, 0)
    assert out.shape == (3, 8)
    (name, send), (name2, recv) = fake_ascend.calls
    assert name == "async_dispatch_send" and name2 == "async_combine_recv"
    # x, topk_ids, comm_args, comm_id, max_seq_len, batch, hidden, topk, ffn, attn, experts/rank, rank, world,
    # layer, tp, dynamic_quant, group
    assert send[3:] == (0, 8192, 3, 8, 2, 2, 2, 2, 1, 4, 2, 2, 1, "hcom_7")
    assert send[0] is x and torch.equal(send[1], ids)
    # placeholder, topk_ids, topk_weights, comm_args, comm_id, batch, hidden, topk, ffn, attn, experts/rank, rank,
    # world, group
    assert recv[4:] == (0, 3, 8, 2, 2, 2, 2, 1, 4, "hcom_7")

    fake_ascend.calls.clear()
    ffn = connector("ffn", 1, num_attention_ranks=2, num_ffn_ranks=2, connector_extra_config=extra)
    ffn.init()
    item = ffn.recv_ffn_work_item(0)
    assert (item.layer_idx, item.num_tokens, item.expert_start, item.group_list.tolist()) == (2, 3, 2, [2, 1])
    ffn.send_ffn_work_item_output(item, torch.zeros(3, 8))
    (_, drecv), (name, csend) = fake_ascend.calls
    # placeholder, comm_args, comm_id, batch, hidden, topk, ffn, attn, experts/rank, rank, world, tp, dq, group
    assert drecv[2:] == (0, 8192, 8, 2, 2, 2, 2, 3, 4, 2, 1, "hcom_7")
    # out, shared, comm_args, token_nums, comm_id, batch, hidden, topk, ffn, attn, experts/rank, rank, world, tp, group
    assert name == "async_combine_send" and csend[4:] == (0, 8192, 8, 2, 2, 2, 2, 3, 4, 2, "hcom_7")


def test_ascend_needs_even_expert_placement(fake_ascend):
    with pytest.raises(AFDConfigError, match="must divide the 4 routed experts"):
        connector(num_ffn_ranks=3, connector_extra_config={"backend": "ascend"})


def test_ascend_refuses_redundant_experts(fake_ascend):
    with pytest.raises(AFDConfigError, match="needs the portable backend") as ei:
        connector(num_ffn_ranks=2, connector_extra_config={"backend": "ascend", "expert_replicas": 2})
    assert ei.value.key == "afd.connector_extra_config.expert_replicas"


def test_ascend_is_chosen_automatically_for_npu_tensors(fake_ascend):
    assert connector(device="npu").backend_name == "ascend"


# --- model side: gate and shared experts on Attention -----------------------------------------


def test_gate_on_attention_split_of_deepseek_v3(tmp_path):
    pytest.importorskip("transformers", reason="the transformers binding needs the [hf] extra")
    from afd_sdk.integrations.transformers import save_tiny_checkpoint
    from afd_sdk.metadata import ContextVarMetadataProvider
    from afd_sdk.proxy import RemoteExperts, RoutedExperts

    arch = "DeepseekV3ForCausalLM"
    model_dir = save_tiny_checkpoint(arch, tmp_path)
    pm = get_plugin_manager()
    from afd_sdk.weights import read_hf_config

    adapter = pm.adapter_class(arch)(arch, read_hf_config(model_dir))
    binding = adapter.binding("transformers")
    moe = adapter.moe_layout()
    attn, report = binding.load_role(
        adapter, model_dir, "attention", provider=ContextVarMetadataProvider(), compute_gate_on_attention=True
    )
    for i, layer in enumerate(attn.model.layers):
        if i in moe.moe_layers:
            assert isinstance(layer.mlp.experts, RemoteExperts)
            assert layer.mlp.gate.weight.abs().sum() > 0 and hasattr(layer.mlp, "shared_experts")
        else:
            assert not isinstance(layer.mlp, RemoteExperts)  # dense layer runs locally
    assert not any(".experts." in n and "shared" not in n for n in report.loaded)
    ffn, ffn_report = binding.load_role(adapter, model_dir, "ffn", compute_gate_on_attention=True, experts=range(1, 3))
    assert isinstance(ffn, RoutedExperts) and (ffn.expert_start, ffn.num_local) == (1, 2)
    # the rank reads its own experts' tensors and nothing else (no gate, no other expert)
    assert ffn_report.loaded and all(".mlp.experts.1." in n or ".mlp.experts.2." in n for n in ffn_report.loaded)
    assert all(m.num_experts == 2 for m in ffn.layers.values())
    assert sum(p.numel() for p in ffn.parameters()) > 0
    native = binding.load_native(model_dir)
    layer = moe.moe_layers[0]
    full = native.model.layers[layer].mlp.experts
    x = torch.randn(5, 32)
    # local expert 0 == global expert 1: the sliced module computes what the native one does for that expert
    got = ffn(layer, x, torch.tensor([3, 2]))
    ids = torch.tensor([1, 1, 1, 2, 2])[:, None]
    want = full(x, ids, torch.ones(5, 1))
    assert torch.allclose(got, want, atol=1e-6)


def test_refuses_ffn_hosts_its_world_meets_at_attention_rank_0():
    cfg = parse_config(
        {
            "role": "attention",
            "connector": "CAMAsyncAFDConnector",
            "compute_gate_on_attention": True,
            "num_ffn_ranks": 2,
            "ffn_hosts": ["10.0.0.3", "10.0.0.4"],
        }
    )
    with pytest.raises(AFDConfigError, match="is not used by CAMAsyncAFDConnector") as info:
        get_plugin_manager().resolve_config(cfg)
    assert info.value.key == "afd.ffn_hosts"


def test_drain_needs_redundant_experts_and_says_why():
    from afd_sdk.runtime.drain import Drain

    assert connector("ffn", num_ffn_ranks=2, connector_extra_config={"expert_replicas": 2}).drain_refusal() is None
    single = Drain()
    single.attach(connector("ffn", num_ffn_ranks=2))
    code, body = single.request("op-1")
    assert code == 501 and "expert_replicas=1" in body["error"] and not single.requested, body
    drainable = Drain()
    cam = connector("ffn", num_ffn_ranks=2, connector_extra_config={"expert_replicas": 2})
    drainable.attach(cam)
    assert drainable.request("op-1")[0] == 202 and cam._drain_requested  # announced in its first beat
