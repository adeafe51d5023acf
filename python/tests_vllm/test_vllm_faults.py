"""A prefill engine killed while a decode loads from it, under both of vLLM's
`kv_load_failure_policy` values: the request ends (failed, or recomputed) and the decode keeps
serving. A failed read is detected; a handshake in flight ends at the handshake timeout."""

import signal
import time
from pathlib import Path

import pytest
from flows import assert_same_output, decode, decode_cmd, prefill, prompt
from harness import MODEL, Engine, free_port, start

# Far below the decodes' 120 s transfer timeout; above their 10 s handshake timeout, which is
# what ends a handshake whose prefill died (see conftest.fault_decodes).
DETECTED_WITHIN = 45


# Each policy and each phase once: the policy acts on the failure report, which is the same
# wherever the prefill died, and each case starts a victim engine, which CI's time budget
# counts.
@pytest.mark.parametrize(("policy", "phase"), [("fail", "read"), ("recompute", "handshake")])
def test_a_prefill_killed_mid_load(
    fault_decodes: dict[str, Engine], fault_logdir: Path, policy: str, phase: str
) -> None:
    d = fault_decodes[policy]
    (victim,) = start(
        [
            Engine(
                f"victim-{policy}-{phase}",
                "0",
                {"side_channel_port": free_port()},
                fault_logdir,
                model=MODEL,
            )
        ]
    )
    x = prompt(31, 100)
    try:
        if phase == "read":
            # The decode knows this prefill already: the kill lands after the handshake.
            w = prompt(30, 64)
            (ok,) = decode(d, [w], prefill(victim, [w]))
            assert ok["finish"] == "length"
        (params,) = prefill(victim, [x])
        if phase == "handshake":
            victim.signal(signal.SIGSTOP)  # its side channel accepts, and never answers
            d.send(decode_cmd([x], [params]))
            time.sleep(2)  # the decode is inside the handshake now
            victim.signal(signal.SIGKILL)
        else:
            victim.signal(signal.SIGKILL)
            victim.proc.wait()
            d.send(decode_cmd([x], [params]))
        (out,) = d.wait(timeout=DETECTED_WITHIN)
    finally:
        victim.close()
    if policy == "fail":
        assert out["finish"] == "error" and out["tokens"] == [], out
    else:
        (local,) = decode(d, [x], [None])
        assert_same_output(out, local)
    assert any("kvxfer: load of" in line for line in d.log_text().splitlines())
    (after,) = decode(d, [prompt(32, 64)], [None])
    assert after["finish"] == "length", "the decode stopped serving"
