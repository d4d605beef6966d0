"""MooncakeDistributedStore's configuration without a store: ReplicateConfig, SoftPinAction, and what setup reads.

Mooncake's binding types ReplicateConfig's fields (a wrong type raises TypeError, an unknown attribute
AttributeError); its dictionary ``setup`` reads sizes such as ``"3200MB"`` in powers of 1024 and refuses
percentages. Each behaviour here is one Mooncake documents or its unit tests hold.
"""
from __future__ import annotations

import pytest

from engram_store import InvalidArgument
from engram_store.compat import ErrorCode, MooncakeDistributedStore, ReplicateConfig, SoftPinAction
from engram_store.compat._replicate import MAX_SOFT_PIN_TTL_MS, DfsUnavailable, write_replicas
from engram_store.compat._setup import SetupRequest, mooncake_size

BASE = {"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE"}


def test_replicate_config_defaults_and_fields():
    config = ReplicateConfig()
    assert (config.replica_num, config.nof_replica_num, config.dfs_replica_num) == (1, 0, 0)
    assert config.soft_pin_action is SoftPinAction.PRESERVE and config.soft_pin_ttl_ms is None
    assert (config.with_hard_pin, config.preferred_segment, config.preferred_segments) == (False, "", [])
    assert config.group_ids is None and config.prefer_alloc_in_same_node is False
    config.replica_num = 3
    config.soft_pin_action = SoftPinAction.ENABLE
    config.preferred_segment = "node1:12345"
    assert (config.replica_num, config.soft_pin_action, config.preferred_segment) == (3, SoftPinAction.ENABLE,
                                                                                      "node1:12345")
    text = str(config)
    assert text.startswith("ReplicateConfig: { replica_num: 3,") and "soft_pin_action: ENABLE" in text
    assert "soft_pin_ttl_ms: default" in text and "preferred_segment (deprecated): node1:12345" in text
    assert int(SoftPinAction.DISABLE) == 2 and str(SoftPinAction.PRESERVE) == "SoftPinAction.PRESERVE"


def test_soft_pin_ttl_is_none_or_an_unsigned_64_bit_integer():
    config = ReplicateConfig()
    config.soft_pin_ttl_ms = 1000
    assert config.soft_pin_ttl_ms == 1000
    config.soft_pin_ttl_ms = (1 << 64) - 1
    assert config.soft_pin_ttl_ms == (1 << 64) - 1
    config.soft_pin_ttl_ms = None
    assert config.soft_pin_ttl_ms is None
    for bad in (-1, 1 << 64, 1.5, "1000", True):
        with pytest.raises(TypeError, match=r"soft_pin_ttl_ms: expected an integer in \[0, 2\*\*64\)"):
            config.soft_pin_ttl_ms = bad
    assert config.soft_pin_ttl_ms is None  # a refused value changes nothing


def test_fields_are_typed_and_closed_as_in_mooncakes_binding():
    config = ReplicateConfig()
    with pytest.raises(TypeError, match=r"soft_pin_action: expected a SoftPinAction \(PRESERVE, .*\), got 1"):
        config.soft_pin_action = 1
    with pytest.raises(TypeError, match="replica_num"):
        config.replica_num = -1
    with pytest.raises(TypeError, match="preferred_segment: expected a string, got 3"):
        config.preferred_segment = 3
    with pytest.raises(TypeError, match="group_ids: expected a list of strings"):
        config.group_ids = "a"
    with pytest.raises(AttributeError, match="replica_nums"):
        config.replica_nums = 2  # a typo is an error, not a silently ignored attribute
    config.with_soft_pin = True  # Mooncake's older flag
    assert config.soft_pin_action is SoftPinAction.ENABLE and config.with_soft_pin


@pytest.mark.parametrize("field, value, code", [
    ("soft_pin_ttl_ms", 1000, ErrorCode.INVALID_PARAMS),               # a TTL needs ENABLE
    ("replica_num", 0, ErrorCode.INVALID_PARAMS),
    ("nof_replica_num", 1, ErrorCode.INVALID_PARAMS),                  # no NVMe-oF pool here
    ("dfs_replica_num", 1, ErrorCode.DFS_SERVICE_UNAVAILABLE),        # no DFS tier here
    ("dfs_replica_num", 2, ErrorCode.INVALID_PARAMS),
    ("group_ids", ["a", "b"], ErrorCode.INVALID_PARAMS),               # one group per key
    ("prefer_alloc_in_same_node", True, ErrorCode.INVALID_PARAMS),     # refused by put from bytes
])
def test_write_checks_refuse_as_mooncakes_master(field, value, code):
    from engram_store.compat._codes import error_code

    config = ReplicateConfig()
    setattr(config, field, value)
    with pytest.raises((InvalidArgument, DfsUnavailable)) as info:
        write_replicas(config, keys=1, staged=True)
    assert error_code(info.value) == code and field in str(info.value)


def test_soft_pin_transitions():
    enable = ReplicateConfig()
    enable.soft_pin_action = SoftPinAction.ENABLE
    assert write_replicas(enable, 1, staged=True) == 1  # ENABLE without a TTL: the master's default
    enable.soft_pin_ttl_ms = MAX_SOFT_PIN_TTL_MS
    assert write_replicas(enable, 1, staged=True) == 1
    enable.soft_pin_ttl_ms = MAX_SOFT_PIN_TTL_MS + 1
    with pytest.raises(InvalidArgument, match="at most 86400000"):
        write_replicas(enable, 1, staged=True)
    for action in (SoftPinAction.PRESERVE, SoftPinAction.DISABLE):
        config = ReplicateConfig()
        config.soft_pin_action = action
        assert write_replicas(config, 1, staged=True) == 1
        config.soft_pin_ttl_ms = 0
        with pytest.raises(InvalidArgument, match=f"only valid with soft_pin_action ENABLE; got 0 with {action.name}"):
            write_replicas(config, 1, staged=True)
    same_node = ReplicateConfig()
    same_node.prefer_alloc_in_same_node = True
    assert write_replicas(same_node, 1, staged=False) == 1  # the zero-copy calls accept it


@pytest.mark.parametrize("text, expected", [
    ("3200MB", 3200 << 20), ("16 MB", 16 << 20), ("16MB", 16 << 20), ("1.5 GB", 3 << 29), ("4096", 4096),
    ("2k", 2048), ("1T", 1 << 40), (" 64 mb ", 64 << 20), (16777216, 16777216),
])
def test_sizes_are_read_as_mooncake_reads_them(text, expected):
    assert mooncake_size(text, "global_segment_size") == expected


@pytest.mark.parametrize("text", ["50%", "2MiB", "-1", "", "MB", "1.5 XB"])
def test_sizes_mooncake_refuses(text):
    with pytest.raises(InvalidArgument, match="global_segment_size: expected a byte count"):
        mooncake_size(text, "global_segment_size")


def test_dictionary_setup_defaults():
    request = SetupRequest.from_dict(BASE)
    assert (request.global_segment_size, request.local_buffer_size) == (16 << 20, 16 << 20)
    assert (request.protocol, request.rdma_devices, request.master) == ("tcp", "", "127.0.0.1:50051")
    assert (request.host, request.port, request.tenant_id) == ("localhost", None, "default")
    request = SetupRequest.from_dict({**BASE, "local_hostname": "node7:17000", "global_segment_size": "3200MB",
                                      "local_buffer_size": 0, "rdma_devices": "mlx5_0",
                                      "master_server_addr": "10.0.0.1:50051", "enable_ssd_offload": True})
    assert (request.host, request.port, request.global_segment_size) == ("node7", 17000, 3200 << 20)
    assert (request.local_buffer_size, request.rdma_devices, request.master) == (0, "mlx5_0", "10.0.0.1:50051")
    assert request.enable_ssd_offload  # accepted; nothing is evicted here, so nothing is offloaded


@pytest.mark.parametrize("config, match", [
    ({"metadata_server": "P2PHANDSHAKE"}, r"config\['local_hostname'\]: required"),
    ({"local_hostname": "localhost"}, r"config\['metadata_server'\]: required"),
    ({**BASE, "local_hostname": ""}, r"config\['local_hostname'\]: required"),
    ({**BASE, "global_segment_size": "50%"}, "expected a byte count"),
    ({**BASE, "global_segment_size": 100}, "expected 0 or at least 1024 bytes, got 100"),
    ({**BASE, "local_buffer_size": "2TB"}, "at most 1099511627776 bytes"),
    ({**BASE, "tenant_id": "team-a"}, "tenant_id: this store has one key namespace"),
    ({**BASE, "enable_client_http_server": "true"}, "enable_client_http_server: this client serves no HTTP"),
    ({**BASE, "client_http_port": "http"}, "client_http_port.*expected an integer"),
])
def test_dictionary_setup_refusals(config, match):
    with pytest.raises(InvalidArgument, match=match):
        SetupRequest.from_dict(config)


def test_setup_refusals_are_codes_and_name_the_argument():
    store = MooncakeDistributedStore()
    assert store.setup({"local_hostname": "localhost"}) == ErrorCode.INVALID_PARAMS
    assert "metadata_server" in str(store.last_error)
    assert store.setup({**BASE, "global_segment_size": "50%"}) == ErrorCode.INVALID_PARAMS
    assert "'50%'" in str(store.last_error)
    assert store.setup("localhost", "P2PHANDSHAKE", 16 << 20, 0, "tcp", "", "", engine=object()) == -600
    assert "engine: this store has no TransferEngine" in str(store.last_error)
    assert store.setup("localhost", "P2PHANDSHAKE", 16 << 20, 0, "tcp", "", "", tenant_id="t1") == -600
    assert store.setup("localhost", "P2PHANDSHAKE", 16 << 20, 0, "tcp", "", "", no_such_argument=1) == -600
    assert "no_such_argument" in str(store.last_error)
    assert store.get_hostname() == "" and store.native_store is None  # nothing was set up
    # calls before a successful setup fail as Mooncake's "client is not initialized": -600, b"", None
    assert store.put("k", b"v") == -600 and "not set up" in str(store.last_error)
    assert store.get("k") == b"" and store.get_buffer("k") is None and store.is_exist("k") == -600
    assert store.get_into_ranges([1], [["k"]], [[[0]]], [[[0]]], [[[1]]]) == [[[-600]]]
