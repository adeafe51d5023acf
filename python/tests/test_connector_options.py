"""The vLLM connectors' options (`kv_connector_extra_config`), read once in kvxfer-core: every
key with its default, an unknown key or a bad value refused by name."""

import json

import pytest

import kvxfer


def options(extra: object, flow: str = "pull") -> dict[str, object]:
    return dict(json.loads(kvxfer.connector_options(json.dumps(extra), flow)))


def test_defaults_fill_every_key() -> None:
    o = options({"side_channel_port": 5700})
    assert o["side_channel_port"] == 5700
    assert (o["lease"], o["transfer_timeout"], o["handshake_timeout"]) == (30.0, 30.0, 5.0)
    assert (o["transport"], o["stop_short"], o["discovery"]) == ("ucx", True, None)
    p = options({"layerwise": "false"}, "push")
    assert (p["layerwise"], p["layerwise_min_tokens"], p["waiting_timeout"]) == (False, 48, 300.0)


@pytest.mark.parametrize(
    ("extra", "flow", "named"),
    [
        ({"side_chanel_port": 5600}, "pull", '"side_chanel_port"'),
        ({"lease": 600}, "push", '"lease" is a KvxferConnector key'),
        ({"layerwise": True}, "pull", '"layerwise" is a KvxferPushConnector key'),
        ({"lease": "30"}, "pull", '"lease"'),
        ({"idle_wait": 2}, "pull", '"idle_wait"'),
        ({"transport": "rdma"}, "push", '"transport"'),
        ({}, "both", "flow"),
    ],
)
def test_an_unknown_key_or_a_bad_value_is_refused_by_name(
    extra: dict[str, object], flow: str, named: str
) -> None:
    with pytest.raises(kvxfer.InvalidArgumentError, match=named):
        options(extra, flow)
