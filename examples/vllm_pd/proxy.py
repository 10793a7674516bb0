"""A small xPyD proxy: the prompt goes to a prefill server with ``max_tokens=1``, the rest
streams from a decode server, which pulls the prompt's KV through kvxfer.

    python examples/vllm_pd/proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

``--prefill`` and ``--decode`` take one URL or more; each request takes the next of each
(round robin, separately), so any prefill server may feed any decode server: the params it
returns name the prefill instance the decode server reads from.

Any OpenAI-style ``/v1/completions`` or ``/v1/chat/completions`` request works, streamed or not.
Standard library only: it is a recipe to copy, not a production router.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("kvxfer.vllm_pd.proxy")
TIMEOUT_S = 300.0
PATHS = ("/v1/completions", "/v1/chat/completions")


def _open(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=TIMEOUT_S)


class RoundRobin:
    """The next URL of a fixed list, from any of the server's threads."""

    def __init__(self, urls: list[str]) -> None:
        self._urls = itertools.cycle([u.rstrip("/") for u in urls])
        self._lock = threading.Lock()

    def next(self) -> str:
        with self._lock:
            return next(self._urls)


class Proxy(BaseHTTPRequestHandler):
    prefills = RoundRobin([""])
    decodes = RoundRobin([""])

    def do_POST(self) -> None:
        if self.path not in PATHS:
            self.send_error(404, f"only {', '.join(PATHS)}")
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except (ValueError, json.JSONDecodeError) as e:
            self.send_error(400, f"bad JSON body: {e}")
            return
        first = dict(body, max_tokens=1, stream=False,
                     kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
        first.pop("max_completion_tokens", None)
        first.pop("stream_options", None)
        prefill_url, decode_url = self.prefills.next(), self.decodes.next()
        try:
            with _open(prefill_url + self.path, first) as r:
                params = json.loads(r.read()).get("kv_transfer_params")
            if not params:
                raise RuntimeError(f"the prefill server {prefill_url} returned no kv_transfer_params")
            upstream = _open(decode_url + self.path, dict(body, kv_transfer_params=params))
        except (urllib.error.URLError, OSError, RuntimeError) as e:
            logger.warning("request failed: %s", e)
            self.send_error(502, str(e))
            return
        with upstream:
            self.send_response(upstream.status)
            for key in ("Content-Type",):
                if upstream.headers.get(key):
                    self.send_header(key, upstream.headers[key])
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := upstream.read1(65536):  # pass streamed events on as they come
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

    def log_message(self, fmt: str, *args: Any) -> None:
        logger.info("%s " + fmt, self.address_string(), *args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", required=True, nargs="+", help="prefill server URLs (round robin)")
    ap.add_argument("--decode", required=True, nargs="+", help="decode server URLs (round robin)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    Proxy.prefills, Proxy.decodes = RoundRobin(args.prefill), RoundRobin(args.decode)
    server = ThreadingHTTPServer((args.host, args.port), Proxy)
    logger.info("proxy on http://%s:%d -> prefill %s, decode %s", args.host, args.port, " ".join(args.prefill),
                " ".join(args.decode))
    server.serve_forever()


if __name__ == "__main__":
    main()
