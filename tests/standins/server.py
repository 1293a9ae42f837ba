"""A tiny stand-in HTTP server with misbehaviours, for launcher tests.

--mode healthy      answers /health, /health_generate, /server_info, /metrics
--mode exit         exits with code 3 at start, after printing an error line
--mode never        listens but /health always answers 503
--mode ignore-term  healthy, but ignores SIGTERM (needs SIGKILL)
--spawn-child       also starts a grandchild (sleep) in the same process group
Unknown arguments (e.g. the reference server's --model ...) are accepted and ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--mode", default=os.environ.get("STANDIN_MODE", "healthy"))
    ap.add_argument("--spawn-child", action="store_true")
    args, _ = ap.parse_known_args()
    print(f"standin pid={os.getpid()} mode={args.mode}", flush=True)
    if args.mode == "exit":
        print("fatal: stand-in refuses to start", flush=True)
        sys.exit(3)
    if args.mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.spawn_child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"standin child pid={child.pid}", flush=True)

    healthy = args.mode != "never"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path in ("/health", "/health_generate"):
                self._send(200 if healthy else 503, "{}")
            elif self.path == "/server_info":
                self._send(200, json.dumps({"standin": True, "pid": os.getpid()}))
            elif self.path == "/metrics":
                self._send(200, "sglang:mamba_used_tokens 0\nsglang:kv_used_tokens 0\n", "text/plain")
            else:
                self._send(404, "{}")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._send(200 if self.path == "/flush_cache" else 404, "{}")

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


def entry(argv: list[str]) -> int:
    """``module:function`` entry for the launcher's forkserver path."""
    sys.argv = ["standin", *argv]
    main()
    return 0


if __name__ == "__main__":
    main()
