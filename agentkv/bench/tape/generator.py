"""The tape generator: sessions of the named workloads (``workloads.py``) walked into a tape."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .. import workloads
from ..topologies import TOPOLOGIES
from ..workloads import AppSpec, declared_graph, stream_seed
from .format import ANCHOR_PREFIX, DEFAULT_OFFSET, DEFAULT_VOCAB, FORMAT, VERSION, Tape, TapeRequest, TimeModel

__all__ = ["WorkloadConfig", "generate"]


@dataclass(frozen=True)
class WorkloadConfig:
    """Parameters of a generated tape (recorded in its header).

    ``topology`` names the workload (``workloads.WORKLOADS``: a six-agent topology or a zoo
    workload) that supplies the apps for the seed; ``apps`` replaces them with any others.
    A session belongs to one app (drawn by weight) and is a run of dispatches along the
    app's chain (restricted to the session's teams, if the app has teams), starting at an
    entry agent. A turn is one LLM call of the agent: its prompt is the agent's shared
    preambles + its anchor + the session history. The call's output joins the history;
    with probability ``tool_use`` of the agent the call ends with a tool call, whose result
    joins the history after the agent's tool gap; otherwise the next turn follows after
    ``handoff_gap``. With ``tool_loop`` the agent is called again after its tool returns
    (same dispatch step; AutoGen's reflection / tool iterations) until a call ends without
    a tool call or ``max_tool_calls`` is reached; the next agent follows then. With
    probability ``abandon`` a session stops after a uniform fraction ``abandon_after`` of
    its dispatches (at least one) and its app never ends it: its last request is marked
    ``abandoned``.
    """

    topology: str = "selector"
    sessions: int = 40
    rate: float = 0.05  # session arrivals per second (Poisson); the preflight rate
    seed: int = 0
    tool_loop: bool = False
    max_tool_calls: int = 6  # per turn, with tool_loop
    abandon: float = 0.0
    abandon_after: tuple[float, float] = (0.2, 0.7)  # share of the planned dispatches an abandoned session runs
    task_tokens: tuple[int, int] = (100, 300)  # the user's request, uniform inclusive
    output_tokens: tuple[int, int] = (30, 140)  # per call, uniform inclusive
    tool_result_tokens: tuple[int, int] = (40, 220)  # per tool call, uniform inclusive
    handoff_gap: float = 0.3  # seconds between turns (AutoGen's inter-turn latency)
    block_size: int = 16
    time_model: TimeModel = field(default_factory=TimeModel)
    apps: tuple[AppSpec, ...] | None = None  # None: the named workload's apps for the seed

    def __post_init__(self) -> None:
        if self.apps is None:
            workloads.kind(self.topology)  # raises for an unknown name
        elif not self.apps:
            raise ValueError("apps must not be empty")
        if self.sessions < 1 or self.rate <= 0:
            raise ValueError("sessions >= 1 and rate > 0 are required")
        if not 0.0 <= self.abandon <= 1.0 or not 0.0 <= self.abandon_after[0] <= self.abandon_after[1] <= 1.0:
            raise ValueError("abandon is a probability and abandon_after a (lo, hi) share within [0, 1]")
        if self.max_tool_calls < 1:
            raise ValueError("max_tool_calls >= 1 is required")

    @classmethod
    def named(cls, name: str, *, sessions: int | None = None, rate: float | None = None, seed: int = 0,
              tool_loop: bool = False) -> WorkloadConfig:
        """The named workload with its own defaults (sessions, rate, tool loops, abandonment)."""
        spec = workloads.kind(name)
        return cls(topology=name, sessions=spec.sessions if sessions is None else sessions,
                   rate=spec.rate if rate is None else rate, seed=seed, tool_loop=tool_loop or spec.tool_loop,
                   max_tool_calls=spec.max_tool_calls, abandon=spec.abandon)

    def resolved_apps(self) -> tuple[AppSpec, ...]:
        return self.apps if self.apps is not None else workloads.kind(self.topology).build(self.seed)

    def to_json(self, apps: tuple[AppSpec, ...]) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "apps"}
        out["time_model"] = asdict(self.time_model)
        out["apps"] = [app.describe() for app in apps]
        return json.loads(json.dumps(out))  # tuples as lists: the header in memory equals the header read back


def _uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


class _Session:
    """The chain one session walks: its app's matrix restricted to the session's teams."""

    def __init__(self, app: AppSpec, rng: np.random.Generator) -> None:
        self.app = app
        self.matrix = np.asarray(app.matrix, dtype=float)
        self.entry = np.asarray(app.entry, dtype=float)
        if app.teams:
            count = 1 + int(rng.choice(len(app.teams_per_session), p=np.asarray(app.teams_per_session)))
            weights = np.asarray(app.team_weights) / sum(app.team_weights)
            chosen = rng.choice(len(app.teams), size=count, replace=False, p=weights)
            excluded = {a for i, team in enumerate(app.teams) if i not in set(chosen.tolist()) for a in team}
            mask = np.array([name not in excluded for name in app.names], dtype=float)
            self.matrix = self.matrix * mask
            self.entry = self.entry * mask
            sums = self.matrix.sum(axis=1, keepdims=True)
            if self.entry.sum() <= 0 or (sums[mask > 0] <= 0).any():
                raise ValueError(f"app {app.name!r}: a team choice leaves an agent without successors")
            self.matrix = np.divide(self.matrix, sums, out=np.zeros_like(self.matrix), where=sums > 0)
            self.entry = self.entry / self.entry.sum()

    def first(self, rng: np.random.Generator) -> int:
        return int(rng.choice(len(self.entry), p=self.entry))

    def next(self, rng: np.random.Generator, current: int) -> int:
        return int(rng.choice(len(self.entry), p=self.matrix[current]))


def generate(config: WorkloadConfig) -> Tape:
    """A tape of ``config.sessions`` sessions; deterministic given the config (incl. seed).

    The six-agent topologies draw from ``default_rng(seed)`` exactly as the first generator
    did (their tapes are unchanged); zoo workloads draw from their own streams.
    """
    apps = config.resolved_apps()
    rng = np.random.default_rng(config.seed if config.topology in TOPOLOGIES and config.apps is None
                                else stream_seed(config.topology, config.seed, 0))
    app_weights = np.asarray([app.weight for app in apps]) / sum(app.weight for app in apps)
    timing = config.time_model
    requests: list[tuple[float, int, int, TapeRequest]] = []
    start = 0.0
    width = max(4, len(str(config.sessions - 1)))
    for number in range(config.sessions):
        start += float(rng.exponential(1.0 / config.rate)) if number else 0.0
        app = apps[int(rng.choice(len(apps), p=app_weights))] if len(apps) > 1 else apps[0]
        session = f"s{number:0{width}d}"
        history: list[tuple[str, int]] = [(f"{session}/task", _uniform(rng, config.task_tokens))]
        walk = _Session(app, rng)
        current = walk.first(rng)
        parent = ""
        t = start
        n_dispatches = _uniform(rng, app.dispatches)
        abandoned = config.abandon > 0 and bool(rng.random() < config.abandon)
        if abandoned:
            n_dispatches = max(1, math.ceil(float(rng.uniform(*config.abandon_after)) * n_dispatches))
        order = 0
        for step in range(n_dispatches):
            agent = app.agents[current]
            anchor = [*agent.shared, (f"{ANCHOR_PREFIX}{agent.name}", agent.anchor_tokens)]
            call = 0
            while True:
                prompt = tuple(anchor + history)
                out = _uniform(rng, config.output_tokens)
                key = f"{session}/{step}.{call}"
                history.append((f"{key}/out", out))
                tool = bool(rng.random() < agent.tool_use)
                if tool:
                    history.append((f"{key}/tool", _uniform(rng, config.tool_result_tokens)))
                    gap = agent.tool_gap.draw(rng)
                again = tool and config.tool_loop and call + 1 < config.max_tool_calls
                last = not again and step + 1 == n_dispatches
                if not tool:
                    gap = 0.0 if last else config.handoff_gap
                elif last:
                    gap = 0.0  # the session is over: nobody waits for this tool
                gap = round(gap, 6)  # as written (to_json): a tape in memory equals the tape read back
                request = TapeRequest(key, round(t, 6), session, agent.name, parent, prompt, out, gap, step,
                                      f"{key}/out", abandoned and last)
                requests.append((t, number, order, request))
                order += 1
                t += timing.duration(sum(n for _, n in prompt), out) + gap
                call += 1
                if not again:
                    break
            parent = agent.name
            current = walk.next(rng, current)
    requests.sort(key=lambda item: item[:3])
    spec = workloads.kind(config.topology) if config.apps is None else None
    header = {
        "format": FORMAT,
        "version": VERSION,
        "name": f"{config.topology}-s{config.seed}",
        "block_size": config.block_size,
        "tokens": {"function": "blake2b-counter", "vocab": DEFAULT_VOCAB, "offset": DEFAULT_OFFSET},
        "seed": config.seed,
        "generator": "agentkv.bench.tape.generate",
        "workload": config.to_json(apps),
        "graph": declared_graph(apps),
        "target_predictability": None if spec is None else spec.target_r,
    }
    tape = Tape(header, [r for *_, r in requests])
    tape.header["summary"] = tape.summary()
    return tape

