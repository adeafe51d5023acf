"""The vLLM connectors' options (`kv_connector_extra_config`), read once in kvxfer-core: every
key with its default, an unknown key or a bad value refused by name."""

import ast
import importlib.util
import json
import re

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


def flow_keys(flow: str) -> dict[str, object]:
    """The keys `flow`'s connector takes, with their defaults (each accepted alone)."""
    keys = {}
    for key, default in options({}, flow).items():
        try:
            options({key: default}, flow)
        except kvxfer.InvalidArgumentError:
            continue
        keys[key] = default
    return keys


def parenthetical(doc: str, key: str) -> str:
    """What the docstring says of ``key`` in the parentheses after its first naming."""
    start = doc.index(f"``{key}`` (") + len(f"``{key}`` (")
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(doc[end], 0)
        end += 1
    return doc[start : end - 1]


def rendered(default: object) -> str:
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    if isinstance(default, str):
        return f"``{default}``"
    return str(default)


def docstring(module: str) -> str:
    """`module`'s docstring, read from its source (importing it needs torch)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    with open(spec.origin, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def test_the_vllm_connectors_documented_defaults_are_the_cores() -> None:
    # kvxfer.vllm's docstring tells operators each key's default; the core holds them.
    doc = docstring("kvxfer.vllm")
    keys = flow_keys("pull")
    assert {"lease", "transport", "stop_short"} <= keys.keys()
    for key, default in keys.items():
        said = parenthetical(doc, key)
        if default is not None:
            assert re.search(rf"(?<![\w.`]){re.escape(rendered(default))}(?![\w.`])", said), (
                f"{key}: the core's default {default!r} is not in its description ({said!r})"
            )
    push_doc = " ".join(docstring("kvxfer.vllm_push").split())
    push = flow_keys("push")
    assert {"layerwise", "bootstrap_timeout"} <= push.keys()
    for key in push:
        assert f"``{key}``" in push_doc, f"{key} undocumented in kvxfer.vllm_push"
