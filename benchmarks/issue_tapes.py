r"""Issue tapes: tapes shaped like the four workloads of issue 10's table, written from the issue
text and the format spec alone (docs/tapes.md, "Format (version 1)"); a check, not a tuning set.

Nothing here is derived from the project's own generator, workloads, topologies or policies, and
the parameters below were fixed before any replay: do not tune them (or a policy) on the results.

    .venv/bin/python benchmarks/issue_tapes.py [--out .build/issue-tapes]
    .venv/bin/python -m agentkv bench replay .build/issue-tapes/*.jsonl --policies lru,agentkv,belady \
        --jobs 2 --out .build/issue-replay

Writes 4 workloads x seeds {0, 1} to OUT/<name>-i<seed>.jsonl (tape format version 1).

Common to all four
------------------
* Prompt of a call of agent X in session S: [anchor/<app> preamble (50-200 tokens, one per app),
  anchor/<X> (300-2000 tokens, drawn per agent and tape from a role range)] + the session's history:
  S/task (100-400 tokens), then every earlier call's output (<id>/out) and tool result
  (S/tool<k>, 50-400 tokens), in order. A later call of the same agent repeats its earlier prompt.
* output_tokens: 30-200 (a per-role range; a call that ends in a tool call writes 30-90 tokens).
* Tool loops: after a call, agent X calls a tool with its probability p(X); the tool's time is
  log-normal (a per-workload median, clipped at 60 s); X is then called again in the same step with
  the tool result appended, until a call ends without a tool call or 4 calls were made (the 4th
  call always answers). A loop's later calls name X itself as `parent` (the session's previous
  request was X's, and a `""` there would restart the session), so agents with p > 0 have a
  self-edge in the declared graph. Every other call's parent is the previous dispatch's agent.
* tool_gap: the tool time after a call that called a tool; 0.2-1.0 s (uniform) between hand-offs;
  0 on a session's last request.
* Sessions: 35-45 per tape, Poisson arrivals (the first at t = 0); rate = L / mean session
  duration with L uniform in [3, 4] per tape, so ~2-5 sessions are live at once.
* Times: a session's request k arrives at start + sum over its earlier requests of
  (0.005 + prompt_tokens / 10000 + 0.010 * output_tokens + tool_gap) s; all sessions' requests are
  merged by t and numbered r0, r1, ... in that order.
* Every draw comes from random.Random seeded with a string of the workload's name and the seed.

The workloads
-------------
hierarchy   24 agents: director, lead-1..lead-4, 19 workers (w1-1..w1-4, w2-1..w2-5, w3-1..w3-5,
            w4-1..w4-5). A session is a walk of 11-23 dispatches (odd: it starts and ends with
            the director) inside one team (60%) or two (40%): the director delegates to a lead
            (the first team's with p 0.65 when there are two); a lead that was just delegated to
            hands the task to a worker; a lead that got a worker's report hands to another worker
            (p 0.55) or reports to the director (0.45); a worker always reports to its lead. A
            lead uses a session-specific subset of 2-4 of its workers. Near the end the walk is
            forced upwards so that the last dispatch is the director's. Workers call tools with
            p 0.3 (median 3 s). Anchors: anchor/org 50-200; director 1200-2000, leads 700-1400,
            workers 300-1100.
two-apps    Two apps, each session picks one with p 0.5 (sessions interleave on one server).
            pipeline: pipe-a -> pipe-b -> pipe-c -> pipe-d -> pipe-e, run 1 (p 0.5), 2 (0.3) or 3
            (0.2) times in a session (pipe-e -> pipe-a between runs), no tools.
            team: team-a..team-f, 6-16 dispatches, the first agent and each next agent uniformly
            random (the next among the other five), tools with p 0.15 (median 2 s).
            Anchors: anchor/pipe, anchor/team 50-200; agents 300-1500.
tool-heavy  6 agents (a coding assistant): planner (entry), searcher, coder, runner, reviewer,
            writer; 5-12 dispatches on a fixed transition table (TOOL_HEAVY_NEXT); tool
            probabilities planner 0.3, searcher 0.85, coder 0.7, runner 0.9, reviewer 0.35,
            writer 0.2; tool time log-normal, median 6 s, sigma 1.0, clipped at 60 s.
            Anchors: anchor/tools 50-200; agents 400-2000.
drop-off    6 agents (a support desk): triage (entry), billing, tech, account, escalation, closer;
            a session walks DROP_OFF_NEXT until the closer answers (forced at the 12th dispatch),
            3-12 dispatches; tools: billing 0.4, tech 0.45, account 0.4, escalation 0.2, triage
            0.1 (median 2.5 s). A third of the sessions (round(n / 3), chosen at random) stop
            after 30-80% of their requests and never end: their last request is
            "abandoned": true. Anchors: anchor/desk 50-200; agents 300-1600.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SEEDS = (0, 1)
BLOCK_SIZE = 16
MAX_LOOP_CALLS = 4
TOOL_GAP_CLIP = 60.0


@dataclass(frozen=True)
class Agent:
    name: str
    app: str
    anchor: tuple[int, int]  # anchor token range, drawn once per tape
    out: tuple[int, int]  # output tokens of an answering call
    tool_p: float = 0.0
    tool_median: float = 0.0
    tool_sigma: float = 1.0


@dataclass
class Workload:
    name: str
    agents: list[Agent]
    edges: list[tuple[str, str]]  # declared hand-offs; self-edges for tool users are added
    entry: list[str]
    # rng -> (app, the session's dispatch sequence)
    sample: Callable[[random.Random], tuple[str, list[str]]]
    abandon_share: float = 0.0


@dataclass
class Call:
    session: str
    agent: str
    parent: str
    step: int
    segments: list[tuple[str, int]]
    out_key: str  # provisional "<pid>/out", renamed to the final id
    output_tokens: int
    tool_time: float | None  # the tool's time when this call ended in a tool call
    tool_gap: float = 0.0
    abandoned: bool = False
    t: float = 0.0


@dataclass
class Session:
    sid: str
    app: str
    calls: list[Call] = field(default_factory=list)
    start: float = 0.0

    def duration(self) -> float:
        return sum(service_time(c) + c.tool_gap for c in self.calls)


def service_time(c: Call) -> float:
    prompt = sum(n for _, n in c.segments)
    return 0.005 + prompt / 10000 + 0.010 * c.output_tokens


# --- the four workloads -------------------------------------------------------------------------


def hierarchy() -> Workload:
    team_sizes = (4, 5, 5, 5)
    agents = [Agent("director", "org", (1200, 2000), (80, 200))]
    workers: dict[int, list[str]] = {}
    edges: list[tuple[str, str]] = []
    for team, size in enumerate(team_sizes, 1):
        lead = f"lead-{team}"
        agents.append(Agent(lead, "org", (700, 1400), (50, 160)))
        edges += [("director", lead), (lead, "director")]
        workers[team] = [f"w{team}-{i}" for i in range(1, size + 1)]
        for w in workers[team]:
            agents.append(Agent(w, "org", (300, 1100), (60, 200), tool_p=0.3, tool_median=3.0, tool_sigma=0.8))
            edges += [(lead, w), (w, lead)]
    assert len(agents) == 24

    def dist(agent: str) -> int:  # dispatches needed to get back to the director
        return 0 if agent == "director" else 1 if agent.startswith("lead-") else 2

    def sample(rng: random.Random) -> tuple[str, list[str]]:
        n = rng.choice(range(11, 24, 2))
        teams = rng.sample(range(1, 5), 2 if rng.random() < 0.4 else 1)
        pool = {t: rng.sample(workers[t], rng.randint(2, min(4, len(workers[t])))) for t in teams}
        seq = ["director"]
        while len(seq) < n:
            cur, remaining = seq[-1], n - len(seq)  # dispatches still to make after cur
            if cur == "director":
                team = teams[0] if len(teams) == 1 or rng.random() < 0.65 else teams[1]
                nxt = f"lead-{team}"
            elif cur.startswith("lead-"):
                team = int(cur.split("-")[1])
                just_delegated = seq[-2] == "director"
                to_worker = just_delegated or rng.random() < 0.55
                if remaining - 1 < dist("w") or not to_worker:
                    nxt = "director"
                else:
                    nxt = rng.choice(pool[team])
            else:
                nxt = f"lead-{cur[1]}"
            seq.append(nxt)
        assert seq[-1] == "director"
        return "org", seq

    return Workload("hierarchy", agents, edges, ["director"], sample)


def two_apps() -> Workload:
    pipe = [f"pipe-{c}" for c in "abcde"]
    team = [f"team-{c}" for c in "abcdef"]
    agents = [Agent(a, "pipe", (300, 1500), (30, 200)) for a in pipe]
    agents += [Agent(a, "team", (300, 1500), (40, 200), tool_p=0.15, tool_median=2.0) for a in team]
    edges = [*itertools.pairwise(pipe), (pipe[-1], pipe[0])]
    edges += [(a, b) for a in team for b in team if a != b]

    def sample(rng: random.Random) -> tuple[str, list[str]]:
        if rng.random() < 0.5:
            runs = rng.choices((1, 2, 3), weights=(0.5, 0.3, 0.2))[0]
            return "pipe", pipe * runs
        seq = [rng.choice(team)]
        for _ in range(rng.randint(6, 16) - 1):
            seq.append(rng.choice([a for a in team if a != seq[-1]]))
        return "team", seq

    return Workload("two-apps", agents, edges, [pipe[0], *team], sample)


TOOL_HEAVY_NEXT: dict[str, dict[str, float]] = {
    "planner": {"searcher": 0.4, "coder": 0.5, "writer": 0.1},
    "searcher": {"planner": 0.3, "coder": 0.5, "writer": 0.2},
    "coder": {"runner": 0.6, "reviewer": 0.3, "searcher": 0.1},
    "runner": {"coder": 0.5, "reviewer": 0.4, "planner": 0.1},
    "reviewer": {"coder": 0.4, "writer": 0.35, "planner": 0.25},
    "writer": {"planner": 1.0},
}


def markov(rng: random.Random, table: dict[str, dict[str, float]], cur: str) -> str:
    nxt = list(table[cur])
    return rng.choices(nxt, weights=[table[cur][a] for a in nxt])[0]


def tool_heavy() -> Workload:
    tool_p = {"planner": 0.3, "searcher": 0.85, "coder": 0.7, "runner": 0.9, "reviewer": 0.35, "writer": 0.2}
    outs = {
        "planner": (60, 180),
        "searcher": (40, 150),
        "coder": (80, 200),
        "runner": (30, 120),
        "reviewer": (50, 180),
        "writer": (80, 200),
    }
    agents = [
        Agent(a, "tools", (400, 2000), outs[a], tool_p=p, tool_median=6.0, tool_sigma=1.0) for a, p in tool_p.items()
    ]
    edges = [(a, b) for a, row in TOOL_HEAVY_NEXT.items() for b in row]

    def sample(rng: random.Random) -> tuple[str, list[str]]:
        seq = ["planner"]
        for _ in range(rng.randint(5, 12) - 1):
            seq.append(markov(rng, TOOL_HEAVY_NEXT, seq[-1]))
        return "tools", seq

    return Workload("tool-heavy", agents, edges, ["planner"], sample)


DROP_OFF_NEXT: dict[str, dict[str, float]] = {
    "triage": {"billing": 0.35, "tech": 0.4, "account": 0.25},
    "billing": {"triage": 0.15, "account": 0.2, "escalation": 0.15, "closer": 0.5},
    "tech": {"triage": 0.1, "account": 0.1, "escalation": 0.25, "closer": 0.55},
    "account": {"billing": 0.25, "triage": 0.1, "closer": 0.65},
    "escalation": {"billing": 0.3, "tech": 0.3, "closer": 0.4},
}


def drop_off() -> Workload:
    tool_p = {"triage": 0.1, "billing": 0.4, "tech": 0.45, "account": 0.4, "escalation": 0.2, "closer": 0.0}
    outs = {
        "triage": (30, 100),
        "billing": (60, 180),
        "tech": (60, 200),
        "account": (50, 160),
        "escalation": (80, 200),
        "closer": (60, 160),
    }
    agents = [
        Agent(a, "desk", (300, 1600), outs[a], tool_p=p, tool_median=2.5, tool_sigma=0.9) for a, p in tool_p.items()
    ]
    edges = [(a, b) for a, row in DROP_OFF_NEXT.items() for b in row]

    def sample(rng: random.Random) -> tuple[str, list[str]]:
        seq = ["triage"]
        while seq[-1] != "closer":  # at most 12 dispatches: from the 10th on, a specialist closes
            seq.append("closer" if len(seq) >= 10 and seq[-1] != "triage" else markov(rng, DROP_OFF_NEXT, seq[-1]))
        return "desk", seq

    return Workload("drop-off", agents, edges, ["triage"], sample, abandon_share=1 / 3)


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "hierarchy": hierarchy,
    "two-apps": two_apps,
    "tool-heavy": tool_heavy,
    "drop-off": drop_off,
}


# --- generation ---------------------------------------------------------------------------------


def tool_time(rng: random.Random, a: Agent) -> float:
    return round(min(TOOL_GAP_CLIP, rng.lognormvariate(math.log(a.tool_median), a.tool_sigma)), 3)


def run_session(
    rng: random.Random, sid: str, app: str, seq: list[str], specs: dict[str, Agent], anchors: dict[str, int]
) -> Session:
    s = Session(sid, app)
    history: list[tuple[str, int]] = [(f"{sid}/task", rng.randint(100, 400))]
    n_tools = 0
    for step, agent in enumerate(seq):
        a = specs[agent]
        parent = seq[step - 1] if step else ""
        prefix = [(f"anchor/{a.app}", anchors[f"anchor/{a.app}"]), (f"anchor/{agent}", anchors[f"anchor/{agent}"])]
        for k in range(MAX_LOOP_CALLS):
            calls_tool = k < MAX_LOOP_CALLS - 1 and rng.random() < a.tool_p
            out = rng.randint(30, 90) if calls_tool else rng.randint(*a.out)
            pid = f"{sid}.{len(s.calls)}"
            c = Call(
                session=sid,
                agent=agent,
                parent=parent if k == 0 else agent,
                step=step,
                segments=prefix + history,
                out_key=f"{pid}/out",
                output_tokens=out,
                tool_time=tool_time(rng, a) if calls_tool else None,
            )
            s.calls.append(c)
            history = [*history, (c.out_key, out)]
            if not calls_tool:
                break
            history.append((f"{sid}/tool{n_tools}", rng.randint(50, 400)))
            n_tools += 1
    return s


def set_gaps(rng: random.Random, s: Session) -> None:
    for i, c in enumerate(s.calls):
        last = i == len(s.calls) - 1
        c.tool_gap = 0.0 if last else c.tool_time if c.tool_time is not None else round(rng.uniform(0.2, 1.0), 3)


def make_tape(name: str, seed: int) -> tuple[dict[str, object], list[dict[str, object]], dict[str, float]]:
    w = WORKLOADS[name]()
    rng = random.Random(f"issue-tapes/{name}/seed{seed}")
    specs = {a.name: a for a in w.agents}
    anchors: dict[str, int] = {}
    for app in sorted({a.app for a in w.agents}):
        anchors[f"anchor/{app}"] = rng.randint(50, 200)
    for a in w.agents:
        anchors[f"anchor/{a.name}"] = rng.randint(*a.anchor)

    n_sessions = rng.randint(35, 45)
    sessions: list[Session] = []
    for k in range(n_sessions):
        app, seq = w.sample(rng)
        sessions.append(run_session(rng, f"s{k:02d}", app, seq, specs, anchors))

    abandoned = 0
    if w.abandon_share:
        for s in rng.sample(sessions, round(n_sessions * w.abandon_share)):
            n = len(s.calls)
            keep = rng.randint(max(1, math.ceil(0.3 * n)), max(1, min(n - 1, math.floor(0.8 * n))))
            del s.calls[keep:]
            s.calls[-1].abandoned = True
            abandoned += 1
    for s in sessions:
        set_gaps(rng, s)

    target_live = rng.uniform(3.0, 4.0)
    mean_duration = sum(s.duration() for s in sessions) / n_sessions
    rate = target_live / mean_duration
    t = 0.0
    for k, s in enumerate(sessions):
        if k:
            t += rng.expovariate(rate)
        s.start = t
        for c in s.calls:
            c.t = t
            t += service_time(c) + c.tool_gap
        t = s.start

    order = sorted(((c.t, k, i, c) for k, s in enumerate(sessions) for i, c in enumerate(s.calls)), key=lambda x: x[:3])
    calls = [c for *_, c in order]
    final = {c.out_key: f"r{i}/out" for i, c in enumerate(calls)}

    # the declared graph: every agent, every hand-off, a self-edge for each tool user
    edges = list(dict.fromkeys([*w.edges, *((a.name, a.name) for a in w.agents if a.tool_p > 0)]))
    nodes = [a.name for a in w.agents]
    declared = set(edges)
    for c in calls:
        assert not c.parent or (c.parent, c.agent) in declared, (name, c.parent, c.agent)
        assert c.parent or c.agent in w.entry, (name, c.agent)

    header: dict[str, object] = {
        "format": "agentkv-tape",
        "version": 1,
        "block_size": BLOCK_SIZE,
        "name": f"{name}-i{seed}",
        "seed": seed,
        "graph": {"nodes": nodes, "edges": [list(e) for e in edges], "entry": w.entry},
        "generator": {
            "script": "benchmarks/issue_tapes.py",
            "workload": name,
            "sessions": n_sessions,
            "rate": round(rate, 6),
            "target_live": round(target_live, 3),
        },
    }
    lines: list[dict[str, object]] = []
    for c in calls:
        line: dict[str, object] = {
            "t": round(c.t, 6),
            "session": c.session,
            "agent": c.agent,
            "parent": c.parent,
            "step": c.step,
            "segments": [[final.get(k, k), n] for k, n in c.segments],
            "output_tokens": c.output_tokens,
            "tool_gap": c.tool_gap,
        }
        if c.abandoned:
            line["abandoned"] = True
        lines.append(line)
    times = [round(c.t, 6) for c in calls]
    assert all(a <= b for a, b in itertools.pairwise(times))

    end = max(s.start + s.duration() for s in sessions)
    prompt = [sum(n for _, n in c.segments) for c in calls]
    anchor_tokens = sum(n for c in calls for k, n in c.segments if k.startswith("anchor/"))
    stats = {
        "sessions": n_sessions,
        "requests": len(calls),
        "abandoned": abandoned,
        "span_s": end,
        "mean_live": sum(s.duration() for s in sessions) / end,
        "mean_prompt": sum(prompt) / len(prompt),
        "anchor_share": anchor_tokens / sum(prompt),
        "tool_calls": sum(c.tool_time is not None for c in calls),
    }
    return header, lines, stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--out", type=Path, default=Path(".build/issue-tapes"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in WORKLOADS:
        for seed in SEEDS:
            header, lines, st = make_tape(name, seed)
            path = args.out / f"{name}-i{seed}.jsonl"
            with path.open("w", encoding="utf-8") as f:
                f.write(json.dumps(header, allow_nan=False) + "\n")
                for line in lines:
                    f.write(json.dumps(line, allow_nan=False) + "\n")
            print(
                f"{path}: {st['sessions']} sessions, {st['requests']} requests "
                f"({st['tool_calls']} tool calls, {st['abandoned']} abandoned), span {st['span_s']:.0f} s, "
                f"mean live {st['mean_live']:.2f}, mean prompt {st['mean_prompt']:.0f} tok, "
                f"anchor share {st['anchor_share']:.2f}"
            )


if __name__ == "__main__":
    main()
