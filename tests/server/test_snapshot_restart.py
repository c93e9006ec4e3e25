"""Learned state survives every way a user stops a real server (issue 13, item 8).

One snapshot file, three consecutive servers: each learns a new pipeline and is stopped one way
(SIGKILL to the whole group once a periodic save holds what it learned; SIGINT or SIGTERM to its pid,
as Ctrl-C or ``kill`` does); the next one must start knowing every pipeline learned so far (the one
after the SIGKILL on the control socket path the killed one left behind), and at the end the file
must hold all three. The session timing (the gaps learned between a session's requests) comes back
too: each server starts with the gaps its snapshot held. A server that shut down (SIGINT, SIGTERM)
leaves no control socket file behind; one started with ``AGENTKV_SNAPSHOT_INTERVAL=0`` saves at its shutdown only.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from agentkv.graph import TransitionLearner, load_learned_state, load_snapshot
from agentkv.protocol import STATS_PATH, AgentTag
from agentkv.testing.vllm_server import ServerSpec, VLLMServer

pytestmark = pytest.mark.server

INTERVAL = 2.0  # AGENTKV_SNAPSHOT_INTERVAL of these servers, seconds


def _learn(server: VLLMServer, pipeline: tuple[str, ...], sessions: int = 4) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client:
        for s in range(sessions):
            for step, agent in enumerate(pipeline):
                tag = AgentTag(agent, f"{pipeline[0]}-{s}", "" if step == 0 else pipeline[step - 1], step)
                body = {"model": "tiny", "prompt": [20 + step, 30 + s], "max_tokens": 1}
                client.post("/v1/completions", json=body, headers=tag.to_headers()).raise_for_status()


def _stats(server: VLLMServer) -> dict:
    with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client:
        return client.get(STATS_PATH).json()


def _transitions(server: VLLMServer) -> dict[str, dict[str, float]]:
    return _stats(server)["transitions"]


def _knows(transitions: dict[str, dict[str, float]], pipeline: tuple[str, ...]) -> bool:
    return all(transitions.get(source, {}).get(target, 0.0) > 0.5 for source, target in itertools.pairwise(pipeline))


def _assert_knows(transitions: dict[str, dict[str, float]], pipeline: tuple[str, ...]) -> None:
    assert _knows(transitions, pipeline), (pipeline, transitions)


def _wait_exit(server: VLLMServer, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while server.running and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not server.running, "the server did not exit"
    server.stop()  # reap the group (nothing may be left behind)


def _wait_saved(snapshot: Path, pipeline: tuple[str, ...], timeout: float = 60.0) -> None:
    """Until a periodic save (every INTERVAL s) holds ``pipeline``: a kill leaves only what was saved."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if snapshot.exists():  # written whole by os.replace, never read half-written
            if _knows(_as_transitions(load_snapshot(snapshot)[0]), pipeline):
                return
        time.sleep(INTERVAL / 4)
    raise AssertionError(f"no periodic save held {pipeline} within {timeout} s")


@pytest.mark.timeout(2400)  # three server starts, minutes each on a busy 2-core machine
def test_learned_state_survives_sigkill_sigint_and_sigterm(tiny_model_dir: Path, tmp_path: Path):
    snapshot, control = tmp_path / "state.json", tmp_path / "control.ipc"
    env = {"AGENTKV_SNAPSHOT": str(snapshot), "AGENTKV_CONTROL": f"ipc://{control}"}
    pipelines = [("plan", "code", "test"), ("ask", "search", "answer"), ("draft", "edit", "publish")]
    # (how it stops, AGENTKV_SNAPSHOT_INTERVAL): the SIGKILL first, so that the next server finds the
    # control socket's file the killed one left and takes it over; the SIGINT one saves at shutdown only
    stops = [
        ("SIGKILL", INTERVAL, lambda s: (_wait_saved(snapshot, pipelines[0]), os.killpg(s.pid, signal.SIGKILL))),
        ("SIGINT", 0.0, lambda s: (_assert_not_saved(snapshot, pipelines[1]), os.kill(s.pid, signal.SIGINT))),
        ("SIGTERM", INTERVAL, lambda s: os.kill(s.pid, signal.SIGTERM)),
    ]
    replicas = []
    saved_timing = {"gaps": 0, "agents": 0}
    for number, (pipeline, (name, interval, stop)) in enumerate(zip(pipelines, stops, strict=True)):
        spec = ServerSpec(model_dir=tiny_model_dir, num_gpu_blocks=81, module="agentkv.serve",
                          env={**env, "AGENTKV_SNAPSHOT_INTERVAL": str(interval)})
        with VLLMServer(spec, log_path=tmp_path / f"server-{number}.log") as server:
            stats = _stats(server)
            transitions = stats["transitions"]
            replicas.append(stats["learner"]["replica"])
            for known in pipelines[:number]:
                _assert_knows(transitions, known)  # restored from the snapshot the last stop left
            assert stats["timing"] == saved_timing  # the gaps, too (before session 41 they started from none)
            assert control.exists()
            _learn(server, pipeline)
            stop(server)
            _wait_exit(server)
        assert snapshot.exists(), f"no snapshot after {name}"
        timing = load_learned_state(snapshot).timing
        # each session's 2nd and 3rd request learned a gap: all saved at a shutdown, some by a save before a kill
        assert timing.gaps == saved_timing["gaps"] + 8 or (name == "SIGKILL" and timing.gaps > 0), (name, timing.gaps)
        saved_timing = {"gaps": timing.gaps, "agents": timing.gap_agents}
        # a server that could shut down takes its control socket file along (none piles up in /tmp)
        assert control.exists() == (name == "SIGKILL"), name
    # AGENTKV_REPLICA unset: the restored counts keep their name, so a peer replaces their old export
    # (a new name would sit beside the old one, the same evidence counted twice)
    assert len(set(replicas)) == 1, replicas
    learner, _ = load_snapshot(snapshot)
    for pipeline in pipelines:
        _assert_knows(_as_transitions(learner), pipeline)


def _assert_not_saved(snapshot: Path, pipeline: tuple[str, ...]) -> None:
    """AGENTKV_SNAPSHOT_INTERVAL=0: no periodic save, so what the server learned is not on disk yet."""
    time.sleep(3 * INTERVAL)
    assert not _knows(_as_transitions(load_snapshot(snapshot)[0]), pipeline), "saved before its shutdown"


def _as_transitions(learner: TransitionLearner) -> dict[str, dict[str, float]]:
    matrix, agents = learner.transition_matrix(), learner.agents
    return {a: {b: float(matrix[i, j]) for j, b in enumerate(agents)} for i, a in enumerate(agents)}


def test_a_corrupt_snapshot_is_refused_and_the_server_starts_fresh(tiny_model_dir: Path, tmp_path: Path):
    snapshot = tmp_path / "state.json"
    corrupt = '{"format": "agentkv.learned-state", "version": 1, "learner": {"agents": ["a"], "cou'
    snapshot.write_text(corrupt)
    spec = ServerSpec(model_dir=tiny_model_dir, num_gpu_blocks=81, module="agentkv.serve",
                      extra_args=["--agentkv-snapshot", str(snapshot)])  # the flag; the test above uses the variable
    with VLLMServer(spec, log_path=tmp_path / "server.log") as server:
        assert _transitions(server) == {}
        log = server.log_path.read_text(errors="replace")
        scratch = server.scratch_dir
        assert scratch is not None and any(scratch.iterdir())  # vLLM's sockets and files went there...
    assert "refusing snapshot, starting with fresh learned state" in log
    assert not scratch.exists()  # ...and nothing of this server is left in /tmp
    # the refused file is kept aside: the server's own saves (at shutdown, at the latest) do not replace it
    assert [kept.read_text() for kept in tmp_path.glob("state.json.refused-*")] == [corrupt]
