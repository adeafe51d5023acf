"""A minimal disaggregation proxy for two `vllm serve` OpenAI servers running
KvxferConnector: each completion goes to the prefill server with `max_tokens: 1` and
`kv_transfer_params: {"do_remote_decode": true}`, then to the decode server with the
`kv_transfer_params` the prefill returned, whose answer is the client's.

    python examples/vllm_serve/proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

Standard library only, non-streaming `/v1/completions` (and `/health`); a sketch of what a
production router (vLLM's, or SGLang's) does, not a replacement for one. A prefill's 4xx
answer is passed to the client, any other failure of the prefill is a 502; the decode's
answer, error or not, is passed through.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TIMEOUT = 600.0  # seconds per upstream request; a CPU engine may queue a while
MAX_BODY = 16 << 20  # bytes of a client's request
# Sampling options that would make the one-token prefill request invalid or stop it early.
PREFILL_DROPS = ("min_tokens", "stop", "stop_token_ids", "stream_options")


def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """POSTs `body` as JSON; the status and body, for errors too (502 when the server cannot
    be reached or does not answer within TIMEOUT)."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError as e:  # refused, reset, timed out
        return 502, json.dumps({"error": f"{url}: {e}"}).encode()


def transfer_params(body: bytes) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a completion's answer, if it is one that has them."""
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return params if isinstance(params, dict) else None


def handler(prefill: str, decode: str) -> type[BaseHTTPRequestHandler]:
    class Proxy(BaseHTTPRequestHandler):
        timeout = 60  # seconds a client may take to send its request

        def do_GET(self) -> None:
            self.reply(200, b"{}") if self.path == "/health" else self.reply(404, b"{}")

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self.reply(404, b'{"error": "only /v1/completions"}')
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
                if not 0 <= length <= MAX_BODY:
                    raise ValueError(f"Content-Length {length} outside 0..{MAX_BODY}")
                request = json.loads(self.rfile.read(length))
            except ValueError as e:
                self.reply(400, json.dumps({"error": f"bad request: {e}"}).encode())
                return
            if not isinstance(request, dict):
                self.reply(400, b'{"error": "bad request: not a JSON object"}')
                return
            if request.get("stream"):
                self.reply(400, b'{"error": "this proxy does not stream"}')
                return
            first = {k: v for k, v in request.items() if k not in PREFILL_DROPS}
            first.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            status, body = post(prefill + "/v1/completions", first)
            if status != 200:
                # The client's own error (4xx) as the prefill gave it; else the prefill failed.
                self.reply(status if 400 <= status < 500 else 502, body)
                return
            params = transfer_params(body)
            if params is None:
                self.reply(
                    502, b'{"error": "the prefill answered without kv_transfer_params"}'
                )
                return
            status, body = post(
                decode + "/v1/completions", dict(request, kv_transfer_params=params)
            )
            self.reply(status, body)

        def reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request on stderr is noise in a test's log

    return Proxy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="the prefill server's base URL")
    ap.add_argument("--decode", required=True, help="the decode server's base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    server = ThreadingHTTPServer(
        (args.host, args.port), handler(args.prefill, args.decode)
    )
    print(f"proxy on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
