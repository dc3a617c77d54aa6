"""A tiny HTTP service on port 8081: /health, and /token (a secret made at start)."""

import http.server
import secrets
from pathlib import Path

TOKEN = secrets.token_hex(16)
Path("/run/service-token").write_text(TOKEN + "\n")


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = {"/health": "ok", "/token": TOKEN}.get(self.path)
        self.send_response(200 if body else 404)
        self.end_headers()
        self.wfile.write((body or "not found").encode() + b"\n")

    def log_message(self, *args: object) -> None:
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", 8081), Handler).serve_forever()
