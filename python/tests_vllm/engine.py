"""One real vLLM engine for the real-engine tests and the benchmark, driven over stdin/stdout:
a JSON command per line in, one `KVX {json}` line per reply out (vLLM's own logs go to stderr).

Commands: {"op": "generate", "requests": [{"prompt": [ids], "params": dict|null}],
"max_tokens": N} -> per request token ids, logprobs of the chosen tokens, the returned
kv_transfer_params, the finish reason, vLLM's id for it, and the monotonic clock when it was
submitted and when its first token came (a request may carry "on_transferring": "abort" or
"report", acted on once its push room is being written); {"op": "external_tokens"} -> vLLM's
count of prompt tokens loaded through the connector; {"op": "kv_hashes"} -> per layer, sha256
of every non-zero KV block, read from vLLM's own cache tensors in the worker; {"op":
"kv_head_hashes"} -> per TP rank, per layer, per non-zero block, sha256 of each KV head's slice
of the block (vLLM's CPU cache: [blocks, kv_heads, block_size, 2 * head_size]); {"op":
"metrics", "prefix": P} -> vLLM's metrics named P..., summed over their labels; {"op":
"reset_prefix_cache"}; {"op": "quit"}.
Usage: engine.py ROLE MODEL OPTIONS_JSON KV_TRANSFER_CONFIG_JSON, where the options are
`dtype` (float32), `kv_cache_dtype` (auto), `block_size` (32), `prefix_caching` (false),
`max_model_len` (1024), `max_num_seqs` (8), `tp` (tensor parallel size, 1), `attention_backend`
(vLLM's choice), `num_blocks` (the KV cache's blocks: vLLM's choice).
"""

import json
import sys
import time
from typing import Any


def kv_hashes(worker: Any) -> dict[int, dict[int, str]]:
    """Runs in the worker process (collective_rpc): vLLM's KV tensors, block by block."""
    import hashlib

    import torch

    out: dict[int, dict[int, str]] = {}
    for layer, t in enumerate(worker.model_runner.kv_caches):
        blocks = t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)
        nonzero = blocks.any(dim=1).nonzero().flatten().tolist()
        out[layer] = {b: hashlib.sha256(blocks[b].numpy().tobytes()).hexdigest() for b in nonzero}
    return out


def kv_head_hashes(worker: Any) -> dict[int, dict[int, list[str]]]:
    """Runs in each TP worker: per layer and non-zero block, one hash per KV head (dim 1)."""
    import hashlib

    import torch

    out: dict[int, dict[int, list[str]]] = {}
    for layer, t in enumerate(worker.model_runner.kv_caches):
        # Heads outside tokens (HND): each head's slice of a block is one contiguous piece.
        # (One head, as an MLA latent, is contiguous whatever its stride.)
        contiguous = t.shape[1] == 1 or t.stride(1) == t.shape[2] * t.stride(2)
        assert t.dim() == 4 and contiguous, (t.shape, t.stride())
        raw = t.contiguous().view(torch.uint8)  # [blocks, heads, tokens, bytes]
        nonzero = raw.reshape(t.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        out[layer] = {
            b: [hashlib.sha256(raw[b, h].numpy().tobytes()).hexdigest() for h in range(t.shape[1])]
            for b in nonzero
        }
    return out


def push_posts(worker: Any) -> dict[str, int]:
    """The worker's KvxferPushConnector post counters (layer chunks, whole-page sends)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return dict(get_kv_transfer_group().posts)


def push_room_ready(worker: Any, room: int) -> bool:
    """Whether the worker's KvxferPushConnector prefill has `room`'s destinations."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return bool(get_kv_transfer_group()._prefill.destinations_ready(room))


def push_decode_status(worker: Any, room: int) -> int | None:
    """The worker's KvxferPushConnector decode status of `room` (kvxfer's RoomStatus: 3 is
    Transferring, some layer of it written and not all), or None when unknown."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    decode = get_kv_transfer_group()._decode
    return None if decode is None else decode.status(room)


TRANSFERRING = 3


def room_of(request_id: str) -> int:
    from kvxfer.vllm_push import room_of as room

    return room(request_id)


def reply(obj: object) -> None:
    sys.stdout.write("KVX " + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Commands:
    """stdin's commands, one line each. With EngineCore in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0, the test harness's default) nothing steps the engine
    between commands, so while one is awaited this steps it as EngineCore's own busy loop
    would in its process: while its scheduler has requests (held blocks, delayed frees,
    loads in flight), with a 1 ms pause after a step that ran no model."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        # InprocClient.engine_core: the EngineCore itself (absent with a separate process).
        core = getattr(engine.engine_core, "engine_core", None)
        self.scheduler = getattr(core, "scheduler", None)
        self.buf = b""

    def __iter__(self) -> "Commands":
        return self

    def __next__(self) -> str:
        import os
        import select

        while b"\n" not in self.buf:
            busy = self.scheduler is not None and self.scheduler.has_requests()
            ready, _, _ = select.select([0], [], [], 0 if busy else None)
            if ready:
                chunk = os.read(0, 65536)
                if not chunk:
                    raise StopIteration
                self.buf += chunk
            elif busy and not self.engine.step():
                time.sleep(0.001)
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode()


def calm_shm_readers(_worker: Any = None) -> None:
    """Makes this process's readers of vLLM's shared-memory queues sleep on their socket at
    once instead of busy-waiting (sched_yield) for 1 s after each message. A TP engine's
    workers read one message per engine step: while a request waits for its KV the engine
    steps back to back, and each worker then spins a whole core. On a host of its own that
    buys latency; beside other engines pinned to the same two cores it starved them for
    minutes (the "CPU TP stall" of RELIABILITY.md). vLLM's wake-up through the socket is
    sometimes missed (its readers then recheck after 5 s): they recheck every 10 ms here.
    Runs in the engine's process and, through `collective_rpc`, in each worker's (vLLM
    spawns them)."""
    from vllm.distributed.device_communicators import shm_broadcast

    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = 10
    cls: Any = shm_broadcast.SpinCondition
    if getattr(cls, "_kvxfer_calm", False):
        return
    wait = cls.wait

    def calm_wait(self: Any, timeout_ms: int | None = None) -> None:
        self.busy_loop_s = 0
        wait(self, timeout_ms)

    cls.wait = calm_wait
    cls._kvxfer_calm = True


def main() -> None:
    role, model = sys.argv[1], sys.argv[2]
    opts, ktc = json.loads(sys.argv[3]), json.loads(sys.argv[4])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    calm_shm_readers()
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype=opts.get("dtype", "float32"),
        seed=0,
        max_model_len=int(opts.get("max_model_len", 1024)),
        max_num_seqs=int(opts.get("max_num_seqs", 8)),
        kv_cache_dtype=opts.get("kv_cache_dtype", "auto"),
        block_size=int(opts.get("block_size", 32)),
        enforce_eager=True,
        enable_prefix_caching=bool(opts.get("prefix_caching", False)),
        tensor_parallel_size=int(opts.get("tp", 1)),
        num_gpu_blocks_override=opts.get("num_blocks"),
        attention_backend=opts.get("attention_backend"),
        disable_log_stats=False,
        kv_transfer_config=ktc,
        # Smaller steps split a prompt's prefill over several (chunked prefill).
        **(
            {"max_num_batched_tokens": int(opts["max_num_batched_tokens"])}
            if "max_num_batched_tokens" in opts
            else {}
        ),
    )
    if int(opts.get("tp", 1)) > 1:
        llm.collective_rpc(calm_shm_readers)
    engine = llm.llm_engine
    reply({"ready": role})
    n = 0
    for line in Commands(engine):
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "external_tokens":
            # Prompt tokens loaded through the connector rather than computed, from vLLM's
            # own Prometheus counter.
            total = sum(
                getattr(m, "value", 0)
                for m in llm.get_metrics()
                if m.name == "vllm:prompt_tokens_by_source"
                and m.labels.get("source") == "external_kv_transfer"
            )
            reply(total)
            continue
        if op == "metrics":
            # vLLM's Prometheus metrics whose names start with `prefix`, summed over labels.
            sums: dict[str, float] = {}
            for m in llm.get_metrics():
                if m.name.startswith(cmd["prefix"]) and hasattr(m, "value"):
                    sums[m.name] = sums.get(m.name, 0) + m.value
            reply(sums)
            continue
        if op == "kv_hashes":
            reply(llm.collective_rpc(kv_hashes)[0])
            continue
        if op == "push_room_ready":
            # Whether every worker's prefill knows the decode's room for request `id`.
            room = room_of(cmd["id"])
            reply(all(llm.collective_rpc(push_room_ready, args=(room,))))
            continue
        if op == "push_posts":
            # KvxferPushConnector's post counters, per worker.
            reply(llm.collective_rpc(push_posts))
            continue
        if op == "kv_head_hashes":
            reply(llm.collective_rpc(kv_head_hashes))
            continue
        if op == "reset_prefix_cache":
            reply(llm.reset_prefix_cache())
            continue
        ids, submitted = [], {}
        # Requests to act on once their push room is Transferring (the prefill's WRITEs have
        # begun and not ended): "abort" aborts the request then, "report" replies
        # {"transferring": id} at once (before the command's own reply).
        watch: dict[str, str] = {}
        for r in cmd["requests"]:
            extra = {"kv_transfer_params": r["params"]} if r.get("params") is not None else None
            sp = SamplingParams(
                max_tokens=cmd["max_tokens"],
                temperature=0.0,
                ignore_eos=True,
                detokenize=False,
                logprobs=1,
                extra_args=extra,
            )
            # A request may name its id (the push flow: both engines get the router's id).
            rid = str(r.get("id") or f"{role}-{n}")
            n += 1
            submitted[rid] = time.monotonic()
            engine.add_request(rid, TokensPrompt(prompt_token_ids=r["prompt"]), sp)
            ids.append(rid)
            if r.get("on_transferring"):
                watch[rid] = r["on_transferring"]
        done: dict[str, Any] = {}
        first: dict[str, float] = {}
        while engine.has_unfinished_requests():
            for rid, action in list(watch.items()):
                statuses = llm.collective_rpc(push_decode_status, args=(room_of(rid),))
                if TRANSFERRING in statuses:
                    del watch[rid]
                    if action == "abort":
                        # vLLM's front end forgets an aborted request: no output comes.
                        engine.abort_request([rid])
                        done[rid] = {"finish": "aborted", "tokens": [], "params": None}
                    else:
                        reply({"transferring": rid})
            outs = engine.step()
            if not outs:
                time.sleep(0.001)  # as EngineCore after a step without output: threads run
            for o in outs:
                # vLLM may suffix the id it was given.
                rid = next(
                    (i for i in ids if o.request_id in (i,) or o.request_id.startswith(i + "-")),
                    o.request_id,
                )
                c = o.outputs[0]
                if c.token_ids and rid not in first:
                    first[rid] = time.monotonic()
                if o.finished:
                    lps = [
                        lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [], strict=False)
                    ]
                    done[rid] = {
                        "tokens": list(c.token_ids),
                        "logprobs": lps,
                        "params": o.kv_transfer_params,
                        "finish": c.finish_reason,
                        "engine_request_id": o.request_id,
                        "submitted": submitted[rid],
                        "first_token": first.get(rid),
                    }
        reply([done.get(i) for i in ids])


if __name__ == "__main__":
    main()
