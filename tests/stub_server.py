"""A local OpenAI-compatible completions server for tests: counts calls, can start late,
fail, or answer slowly."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubServer:
    def __init__(self, fail_first: int = 0, delay_s: float = 0.0, status: int = 500, choice: dict | None = None):
        """choice: extra fields of every answer's choice (e.g. stop_reason, token_ids, finish_reason)."""
        self.calls = {"models": 0, "completions": 0}
        self.choice, self.payloads = dict(choice or {}), []
        self.fail_first, self.delay_s, self.status = fail_first, delay_s, status
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                with stub.lock:
                    stub.calls["models"] += 1
                self._send(200, {"data": [{"id": "stub"}]})

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.calls["completions"] += 1
                    stub.payloads.append(payload)
                    n = stub.calls["completions"]
                if stub.delay_s:
                    time.sleep(stub.delay_s)
                if n <= stub.fail_first:
                    return self._send(stub.status, {"error": "overloaded"})
                text = " reply to: " + payload["prompt"][-20:]
                self._send(200, {"choices": [{"text": text, "finish_reason": "stop", **stub.choice}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.thread = None

    def start(self, after_s: float = 0.0) -> StubServer:
        def serve():
            time.sleep(after_s)
            self.httpd.serve_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
