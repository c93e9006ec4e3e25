"""ServerProcess start-up: a server that lost the port it chose is relaunched on a fresh one."""

from __future__ import annotations

import json
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


# A stand-in for vLLM's API server module: /health, and /v1/completions behind vLLM's key rule
# (the last --api-key, else VLLM_API_KEY); it records the AGENTKV_* and VLLM_API_KEY it was given.
_KEYED_SERVER = """
import http.server, json, os, pathlib, sys
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
key = os.environ.get("VLLM_API_KEY")
for index, arg in enumerate(args):
    if arg == "--api-key":
        key = args[index + 1]
    elif arg.startswith("--api-key="):
        key = arg.split("=", 1)[1]
pathlib.Path(os.environ["SEEN"]).write_text(json.dumps(
    {k: v for k, v in os.environ.items() if k.startswith(("AGENTKV_", "VLLM_API_KEY"))}))
class Keyed(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        ok = key is None or self.headers.get("Authorization") == f"Bearer {key}"
        self.send_response(200 if ok else 401); self.end_headers(); self.wfile.write(b"{}")
print("Application startup complete", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Keyed).serve_forever()
"""


@pytest.mark.parametrize(("extra_args", "env", "exported"), [
    (["--api-key", "K"], {}, {}),
    (["--api-key=K"], {}, {}),
    ([], {"VLLM_API_KEY": "K"}, {}),
    ([], {}, {"VLLM_API_KEY": "K"}),
    (["--api-key=old", "--api-key", "K"], {}, {"VLLM_API_KEY": "other"}),
])
def test_the_first_completion_sends_the_key_the_server_requires(tmp_path, monkeypatch, extra_args, env, exported):
    """vLLM requires ``--api-key K``, ``--api-key=K`` or an exported VLLM_API_KEY alike: a server
    started with any of them passes its first completion (it failed with a 401 for the last two)."""
    from agentkv.launcher import ServerSpec

    (tmp_path / "keyed_server.py").write_text(_KEYED_SERVER)
    for name, value in exported.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AGENTKV_CONTROL", "ipc:///tmp/the-callers-own.ipc")  # one server's endpoint
    seen = tmp_path / "control"
    spec = ServerSpec(tmp_path, module="keyed_server", extra_args=extra_args,
                      env={"PYTHONPATH": str(tmp_path), "SEEN": str(seen), **env})
    with ServerProcess(spec, log_path=tmp_path / "keyed.log", stop_timeout=5).start(timeout=30):
        assert "AGENTKV_CONTROL" not in json.loads(seen.read_text())  # never passed on: each server gets its own


def test_an_isolated_server_takes_no_agentkv_setting_or_key_from_the_caller(tmp_path, monkeypatch):
    """A benchmark's servers (``isolated``) run the settings the benchmark gives them: a snapshot,
    ``AGENTKV_ENABLED=off`` or an API key exported by the caller would change the experiment (the
    key: every call of the benchmark's clients would get a 401)."""
    from agentkv.launcher import ServerSpec

    (tmp_path / "keyed_server.py").write_text(_KEYED_SERVER)
    for name, value in {"AGENTKV_SNAPSHOT": "/tmp/elsewhere.json", "AGENTKV_ENABLED": "off", "VLLM_API_KEY": "K",
                        "AGENTKV_TRACE": "/tmp/callers.jsonl"}.items():
        monkeypatch.setenv(name, value)
    seen = tmp_path / "env"
    spec = ServerSpec(tmp_path, module="keyed_server", env={"PYTHONPATH": str(tmp_path), "SEEN": str(seen),
                                                            "AGENTKV_TRACE": str(tmp_path / "ours.jsonl")})
    server = ServerProcess(spec, log_path=tmp_path / "keyed.log", stop_timeout=5, isolated=True)
    with server.start(timeout=30):
        assert json.loads(seen.read_text()) == {"AGENTKV_TRACE": str(tmp_path / "ours.jsonl")}  # the spec's own
        assert httpx.post(server.base_url + "/v1/completions", json={}, trust_env=False).status_code == 200
