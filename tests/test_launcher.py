"""ServerProcess start-up: a server that lost the port it chose is relaunched on a fresh one."""

from __future__ import annotations

import socket
import sys

import httpx
import pytest

from agentkv.launcher import HOST, Command, ServerProcess

# Serves GET /health on argv[1], or fails as vLLM's API server does when its port is taken.
_HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
try:
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
except OSError as exc:
    print(f"OSError: {exc}", flush=True); sys.exit(1)
server.serve_forever()
"""


def _health_server(tmp_path, port: int | None = None) -> ServerProcess:
    return ServerProcess(Command(lambda port: [sys.executable, "-c", _HEALTH_SERVER, str(port)]), port=port,
                         log_path=tmp_path / "health.log", stop_timeout=5)


def _holding(port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind((HOST, port))
    sock.listen(1)
    return sock


def test_a_server_whose_chosen_port_was_taken_starts_on_a_fresh_one(tmp_path):
    server = _health_server(tmp_path)
    chosen = server.port
    with _holding(chosen), server.start(timeout=30):
        assert server.port != chosen
        assert httpx.get(server.base_url + "/health", trust_env=False).status_code == 200


def test_a_given_port_is_never_swapped_for_another(tmp_path):
    with _holding(0) as held:
        port = held.getsockname()[1]
        server = _health_server(tmp_path, port=port)
        with pytest.raises(RuntimeError, match="Address already in use"):
            server.start(timeout=30)
    assert server.port == port and not server.running
