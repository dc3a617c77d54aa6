#!/bin/sh
cat > /app/server.py <<'PY'
import http.server
import urllib.parse


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        try:
            body = str(int(query["a"][0]) + int(query["b"][0]))
        except (KeyError, ValueError):
            self.send_response(400)
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", 8765), Handler).serve_forever()
PY
nohup python3 /app/server.py > /app/server.log 2>&1 &
