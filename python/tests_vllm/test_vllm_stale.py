"""References that must not be read (#38): a decode handed a reference already consumed,
one computed for another prompt, or one naming blocks the prefill does not have, fails the
request (the decode's `kv_load_failure_policy` is `fail`), counts it, and keeps serving;
vLLM's own NixlConnector would return tokens computed from whatever those blocks hold.
kvxfer's prefill stamps each hold in a table the decode reads after the blocks (see
`kvxfer_core::pull::stamps`): the stamp, not the reference, says whether the blocks read
were the reference's."""

from typing import Any

from flows import assert_same_output, decode, kvxfer_metrics, prefill, prompt
from harness import Engine

STALE = "vllm:kvxfer_stale_references"
VERIFIED = "vllm:kvxfer_verified_references"


def counted(d: Engine) -> tuple[float, float]:
    m = kvxfer_metrics(d)
    return m.get(VERIFIED, 0), m.get(STALE, 0)


def assert_failed(out: dict[str, Any]) -> None:
    assert out["finish"] == "error" and out["tokens"] == [], out


def test_a_consumed_reference_fails_its_second_load(engines: tuple[Engine, Engine]) -> None:
    p, d = engines
    x = prompt(71, 100)
    (params,) = prefill(p, [x])
    verified, stale = counted(d)
    (first,) = decode(d, [x], [params])
    assert first["finish"] == "length", first
    # The first load's read-done note freed the blocks: a prefill step drains it.
    prefill(p, [prompt(72, 40)])
    (again,) = decode(d, [x], [params])
    assert_failed(again)
    assert counted(d) == (verified + 1, stale + 1)


def test_a_reference_to_another_prompts_kv_fails(engines: tuple[Engine, Engine]) -> None:
    p, d = engines
    x, y = prompt(73, 100), prompt(74, 100)
    (params_y,) = prefill(p, [y])
    _, stale = counted(d)
    (out,) = decode(d, [x], [params_y])
    assert_failed(out)
    assert counted(d)[1] == stale + 1
    # The decode keeps serving, from the right reference.
    (params_x,) = prefill(p, [x])
    (remote,) = decode(d, [x], [params_x])
    (local,) = decode(d, [x], [None])
    assert_same_output(remote, local)


def test_block_ids_beyond_the_prefills_cache_fail(engines: tuple[Engine, Engine]) -> None:
    p, d = engines
    x = prompt(75, 100)
    (params,) = prefill(p, [x])
    bad = dict(params)
    bad["remote_block_ids"] = [[1 << 30, (1 << 30) + 1, (1 << 30) + 2, (1 << 30) + 3]]
    (out,) = decode(d, [x], [bad])
    assert_failed(out)
    (remote,) = decode(d, [x], [params])
    assert remote["finish"] == "length", remote
