"""Held-out multi-agent workload tapes (format version 1, docs/tapes.md): a check, not a tuning set.

Written from the format spec alone, without reading the project's generator
(agentkv/bench/tape/generator.py, workloads.py, topologies.py), so that the replay can be checked
on workloads the eviction model was not shaped on. Do not tune parameters on these tapes; report
on them (docs/benchmarks.md, "Held-out workloads"). Seven workloads x seeds {0, 1} ->
OUT/<name>-h<seed>.jsonl:

    .venv/bin/python benchmarks/holdout_tapes.py [--out .build/holdout/tapes]
    .venv/bin/python -m agentkv bench replay .build/holdout/tapes/*.jsonl \
        --policies lru,agentkv,agentkv+warmup,kvflow,belady --out .build/holdout

Timing: each session's requests are timed independently with the replay's default service model
and no cache hits (5 ms + prompt/10,000 s + 10 ms per output token), plus the request's tool_gap;
all sessions are then merged by arrival time.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

BLOCK = 16


def service(prompt: int, out: int) -> float:
    return 0.005 + prompt / 10_000 + 0.010 * out


def loguniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def pick(rng: random.Random, weights: dict[str, float]) -> str:
    keys = list(weights)
    return rng.choices(keys, weights=[weights[k] for k in keys])[0]


def poisson_starts(rng: random.Random, n: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def bursty_starts(rng: random.Random, n: int, burst_rate: float, size: tuple[int, int], spread: float) -> list[float]:
    out: list[float] = []
    t = 0.0
    while len(out) < n:
        k = rng.randint(*size)
        for _ in range(k):
            out.append(t + rng.uniform(0, spread))
        t += rng.expovariate(burst_rate)
    return sorted(out[:n])


class TapeBuilder:
    def __init__(self, name: str, seed: int, workload: dict, tag: str = "h"):
        self.name, self.seed, self.workload, self.tag = name, seed, workload, tag
        self.requests: list[dict] = []
        self.seq = 0

    def session(self, sid: str, start: float) -> Session:
        return Session(self, sid, start)

    def add(self, line: dict) -> None:
        line["_seq"] = self.seq
        self.seq += 1
        self.requests.append(line)

    def write(self, path: Path, graph: dict) -> None:
        for r in self.requests:
            r["t"] = round(r["t"], 6)
        self.requests.sort(key=lambda r: (r["t"], r["_seq"]))
        agents = sorted({r["agent"] for r in self.requests})
        assert set(agents) <= set(graph["nodes"]), set(agents) - set(graph["nodes"])
        header = {
            "format": "agentkv-tape", "version": 1, "block_size": BLOCK,
            "name": f"{self.name}-{self.tag}{self.seed}", "seed": self.seed,
            "workload": {"topology": self.name, "generator": "benchmarks/holdout_tapes.py (held-out)", **self.workload},
            "graph": graph,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(header, sort_keys=True) + "\n")
            for r in self.requests:
                r = {k: v for k, v in r.items() if k != "_seq"}
                f.write(json.dumps(r) + "\n")


class Session:
    """One session's clock, dispatch steps and parents."""

    def __init__(self, tape: TapeBuilder, sid: str, start: float):
        self.tape, self.sid, self.t = tape, sid, start
        self.n = 0
        self.step = -1
        self.parent = ""  # agent of the previous dispatch
        self.current = ""  # agent of the current dispatch
        self.last: dict | None = None

    def dispatch(self, agent: str) -> None:
        """Start a new dispatch (a new step) of ``agent``."""
        if self.step >= 0:
            self.parent = self.current
        self.step += 1
        self.current = agent

    def call(
        self, segments: list, out: int, gap: float, *, t: float | None = None, advance: bool = True
    ) -> tuple[str, int]:
        """One request of the current dispatch; returns (output key, output tokens)."""
        segments = [[k, int(n)] for k, n in segments if int(n) >= 1]
        rid = f"{self.sid}.{self.n}"
        self.n += 1
        at = self.t if t is None else t
        line = {
            "id": rid,
            "t": at,
            "session": self.sid,
            "agent": self.current,
            "parent": self.parent,
            "step": self.step,
            "segments": segments,
            "output_tokens": int(out),
            "tool_gap": round(gap, 6),
        }
        self.tape.add(line)
        self.last = line
        prompt = sum(n for _, n in segments)
        self.end = at + service(prompt, out)
        if advance:
            self.t = self.end + gap
        return f"{rid}/out", int(out)

    def abandon(self) -> None:
        assert self.last is not None
        self.last["abandoned"] = True


def complete_graph(nodes: list[str], entry: list[str], self_loops: bool = False) -> dict:
    return {"nodes": nodes, "edges": [[a, b] for a in nodes for b in nodes if self_loops or a != b], "entry": entry}


def graph_of(nodes: list[str], edges: set[tuple[str, str]], entry: list[str]) -> dict:
    return {"nodes": nodes, "edges": sorted([list(e) for e in edges]), "entry": entry}


# ---------------------------------------------------------------------------------------------
# a. groupchat: AutoGen-style group chat, every speaker sees the whole shared conversation
# ---------------------------------------------------------------------------------------------


def groupchat(seed: int, out: Path) -> None:
    rng = random.Random(f"groupchat/{seed}")
    agents = ["gc.planner", "gc.coder", "gc.critic", "gc.tester", "gc.writer"]
    anchor = {a: rng.randint(600, 2500) for a in agents}
    # fixed preference matrix (row: current speaker -> next speaker); noise: uniform other speaker
    pref = {
        "gc.planner": {"gc.coder": 6, "gc.critic": 1, "gc.tester": 1, "gc.writer": 2},
        "gc.coder": {"gc.planner": 1, "gc.critic": 3, "gc.tester": 5, "gc.writer": 1},
        "gc.critic": {"gc.planner": 2, "gc.coder": 5, "gc.tester": 1, "gc.writer": 2},
        "gc.tester": {"gc.planner": 1, "gc.coder": 5, "gc.critic": 2, "gc.writer": 2},
        "gc.writer": {"gc.planner": 3, "gc.coder": 1, "gc.critic": 4, "gc.tester": 1},
    }
    noise = 0.2
    tool_p = {"gc.planner": 0.0, "gc.coder": 0.35, "gc.critic": 0.0, "gc.tester": 0.6, "gc.writer": 0.1}
    n_sessions, rate = 46, 0.07
    tb = TapeBuilder(
        "groupchat",
        seed,
        {
            "sessions": n_sessions,
            "rate": rate,
            "anchors": anchor,
            "noise": noise,
            "turns": [6, 20],
            "arrivals": "poisson",
        },
    )
    for i, start in enumerate(poisson_starts(rng, n_sessions, rate)):
        s = tb.session(f"gc-{seed}-{i:03d}", start)
        convo = [[f"{s.sid}/task", rng.randint(100, 600)]]
        speaker = "gc.planner"
        for _turn in range(rng.randint(6, 20)):
            s.dispatch(speaker)
            o = rng.randint(40, 400)
            tool = rng.random() < tool_p[speaker]
            gap = loguniform(rng, 0.5, 15) if tool else 0.3
            key, n = s.call([[f"anchor/{speaker}", anchor[speaker]], *convo], o, gap)
            convo.append([key, n])
            if tool:  # the tool result (code execution output) is posted to the chat
                convo.append([f"{key}/tool", rng.randint(50, 800)])
            if rng.random() < noise:
                speaker = rng.choice([a for a in agents if a != speaker])
            else:
                speaker = pick(rng, pref[speaker])
    tb.write(out / f"groupchat-h{seed}.jsonl", complete_graph(agents, ["gc.planner"]))


# ---------------------------------------------------------------------------------------------
# b. common-preamble: 8 agents share anchor/common (1500) + own anchor + own per-session thread
# ---------------------------------------------------------------------------------------------


def common_preamble(seed: int, out: Path) -> None:
    rng = random.Random(f"common-preamble/{seed}")
    router = "cp.router"
    specs = ["cp.billing", "cp.tech", "cp.account", "cp.legal", "cp.sales", "cp.shipping", "cp.returns"]
    agents = [router, *specs]
    anchor = {a: rng.randint(200, 800) for a in agents}
    popularity = {a: w for a, w in zip(specs, [5, 6, 3, 1, 2, 3, 2], strict=True)}
    tool_p = {a: rng.uniform(0.2, 0.7) for a in specs}
    n_sessions, rate = 48, 0.06
    tb = TapeBuilder(
        "common-preamble",
        seed,
        {
            "sessions": n_sessions,
            "rate": rate,
            "anchors": anchor,
            "common": 1500,
            "user_turns": [3, 8],
            "arrivals": "poisson",
        },
    )
    edges = (
        {(router, a) for a in specs} | {(a, router) for a in specs} | {(a, b) for a in specs for b in specs if a != b}
    )
    for i, start in enumerate(poisson_starts(rng, n_sessions, rate)):
        s = tb.session(f"cp-{seed}-{i:03d}", start)
        threads: dict[str, list] = {a: [] for a in agents}
        pre = lambda a: [["anchor/common", 1500], [f"anchor/{a}", anchor[a]]]  # noqa: E731
        turns = rng.randint(3, 8)
        for u in range(turns):
            threads[router].append([f"{s.sid}/user{u}", rng.randint(50, 400)])
            s.dispatch(router)
            key, n = s.call(pre(router) + threads[router], rng.randint(20, 80), 0.3)
            threads[router].append([key, n])
            spec = pick(rng, popularity)
            for hop in range(2):
                s.dispatch(spec)
                threads[spec].append([key, n])  # the hand-off note (router's or previous specialist's output)
                calls = 1
                last_hop = hop == 1 or rng.random() < 0.75
                while True:
                    o = rng.randint(40, 350)
                    tool = calls < 4 and rng.random() < tool_p[spec]
                    if tool:
                        gap = loguniform(rng, 0.5, 12)
                    elif last_hop and u < turns - 1:
                        gap = loguniform(rng, 5, 60)  # the user reads the answer and writes again
                    else:
                        gap = 0.3
                    key, n = s.call(pre(spec) + threads[spec], o, gap)
                    threads[spec].append([key, n])
                    if not tool:
                        break
                    threads[spec].append([f"{key}/tool", rng.randint(50, 800)])
                    calls += 1
                threads[router].append([key, n])  # the answer goes back to the router's thread
                if last_hop:
                    break
                spec = rng.choice([a for a in specs if a != spec])
    tb.write(out / f"common-preamble-h{seed}.jsonl", graph_of(agents, edges, [router]))


# ---------------------------------------------------------------------------------------------
# c. big-teams: 3 teams x (lead + 8 workers) + director; long sessions mostly inside one team
# ---------------------------------------------------------------------------------------------


def big_teams(seed: int, out: Path) -> None:
    rng = random.Random(f"big-teams/{seed}")
    teams = ["alpha", "beta", "gamma"]
    director = "bt.director"
    lead = {tm: f"bt.{tm}.lead" for tm in teams}
    workers = {tm: [f"bt.{tm}.w{i}" for i in range(1, 9)] for tm in teams}
    agents = [director] + [a for tm in teams for a in [lead[tm]] + workers[tm]]
    anchor = {director: rng.randint(1200, 2000)}
    for tm in teams:
        anchor[lead[tm]] = rng.randint(800, 1500)
        for w in workers[tm]:
            anchor[w] = int(loguniform(rng, 300, 2500))
    team_pre = {tm: rng.randint(150, 400) for tm in teams}
    worker_pref = {tm: {w: 1.0 / (k + 1) ** 0.9 for k, w in enumerate(rng.sample(workers[tm], 8))} for tm in teams}
    team_pref = {tm: w for tm, w in zip(teams, rng.sample([5, 3, 2], 3), strict=True)}
    tool_p = {w: rng.uniform(0.3, 0.8) for tm in teams for w in workers[tm]}
    n_sessions, rate = 13, 0.05

    def pre(a: str) -> list:
        tm = a.split(".")[1] if a != director else None
        out = [["anchor/org", 300]]
        if tm:
            out.append([f"anchor/team/{tm}", team_pre[tm]])
        return [*out, [f"anchor/{a}", anchor[a]]]

    edges: set[tuple[str, str]] = set()
    for tm in teams:
        edges |= {(director, lead[tm]), (lead[tm], director)}
        for w in workers[tm]:
            edges |= {(lead[tm], w), (w, lead[tm])} | {(w, v) for v in workers[tm] if v != w}
    tb = TapeBuilder(
        "big-teams",
        seed,
        {
            "sessions": n_sessions,
            "rate": rate,
            "anchors": anchor,
            "team_preamble": team_pre,
            "dispatches": [30, 60],
            "arrivals": "poisson",
        },
    )
    for i, start in enumerate(poisson_starts(rng, n_sessions, rate)):
        s = tb.session(f"bt-{seed}-{i:03d}", start)
        threads: dict[str, list] = {a: [] for a in agents}
        threads[director].append([f"{s.sid}/task", rng.randint(150, 600)])
        planned = rng.randint(30, 60)
        agent, team = director, pick(rng, team_pref)
        handoff: tuple[str, int] | None = None
        for d in range(planned):
            s.dispatch(agent)
            if handoff is not None:
                threads[agent].append(list(handoff))
            if agent != director and agent in workers[team] and handoff is not None and rng.random() < 0.3:
                threads[agent].append([f"{s.sid}/d{d}/brief", rng.randint(50, 300)])  # files the lead attached
            calls = 0
            while True:
                calls += 1
                is_worker = agent.rsplit(".", 1)[-1].startswith("w")
                tool = is_worker and calls <= 3 and rng.random() < tool_p[agent]
                o = rng.randint(30, 250) if agent != director else rng.randint(60, 300)
                gap = loguniform(rng, 0.5, 20) if tool else 0.3
                key, n = s.call(pre(agent) + threads[agent], o, gap)
                threads[agent].append([key, n])
                if not tool:
                    break
                threads[agent].append([f"{key}/tool", rng.randint(50, 600)])
            handoff = (key, n)
            # next agent
            if agent == director:
                if rng.random() < 0.3:
                    team = pick(rng, {tm: w for tm, w in team_pref.items() if tm != team})
                agent = lead[team]
            elif agent == lead[team]:
                agent = director if rng.random() < 0.08 else pick(rng, worker_pref[team])
            else:
                if rng.random() < 0.65:
                    agent = lead[team]
                else:
                    agent = pick(rng, {w: p for w, p in worker_pref[team].items() if w != agent})
    tb.write(out / f"big-teams-h{seed}.jsonl", graph_of(agents, edges, [director]))


# ---------------------------------------------------------------------------------------------
# d. pareto-tools: Pareto tool gaps, tool loops of 1-6 calls, bursty arrivals
# ---------------------------------------------------------------------------------------------


def pareto_tools(seed: int, out: Path) -> None:
    rng = random.Random(f"pareto-tools/{seed}")
    orch = "pt.orchestrator"
    specs = ["pt.search", "pt.browser", "pt.coder", "pt.executor", "pt.analyst"]
    agents = [orch, *specs]
    anchor = {a: int(loguniform(rng, 500, 3000)) for a in agents}
    trans = {
        orch: {"pt.search": 4, "pt.browser": 1, "pt.coder": 4, "pt.executor": 1, "pt.analyst": 2},
        "pt.search": {orch: 3, "pt.browser": 5, "pt.analyst": 1},
        "pt.browser": {orch: 4, "pt.search": 2, "pt.analyst": 2},
        "pt.coder": {orch: 3, "pt.executor": 6},
        "pt.executor": {orch: 3, "pt.coder": 5, "pt.analyst": 1},
        "pt.analyst": {orch: 6, "pt.coder": 1},
    }
    loop_p = {orch: 0.1, "pt.search": 0.7, "pt.browser": 0.75, "pt.coder": 0.5, "pt.executor": 0.8, "pt.analyst": 0.3}
    alpha, xm, cap = 1.3, 0.5, 120.0

    def pareto_gap() -> float:
        return min(cap, xm * rng.paretovariate(alpha))

    n_sessions = 44
    tb = TapeBuilder(
        "pareto-tools",
        seed,
        {
            "sessions": n_sessions,
            "anchors": anchor,
            "gap": {"pareto_alpha": alpha, "xm": xm, "cap": cap},
            "dispatches": [4, 10],
            "tool_loop": [1, 6],
            "arrivals": "bursty: bursts at 1/75 s of 3-8 sessions within 6 s",
        },
    )
    edges = {(a, b) for a, row in trans.items() for b in row}
    for i, start in enumerate(bursty_starts(rng, n_sessions, 1 / 75, (3, 8), 6.0)):
        s = tb.session(f"pt-{seed}-{i:03d}", start)
        threads: dict[str, list] = {a: [] for a in agents}
        task = [f"{s.sid}/task", rng.randint(100, 500)]
        for a in agents:
            threads[a].append(task)
        agent, handoff = orch, None
        for _d in range(rng.randint(4, 10)):
            s.dispatch(agent)
            if handoff is not None:
                threads[agent].append(list(handoff))
            calls = 1
            if rng.random() < loop_p[agent]:
                calls = min(6, 1 + int(rng.expovariate(1 / 2.0)) + 1)  # 2-6 calls in the loop
            for c in range(calls):
                tool = c < calls - 1
                gap = pareto_gap() if tool else 0.3
                key, n = s.call([[f"anchor/{agent}", anchor[agent]]] + threads[agent], rng.randint(20, 300), gap)
                threads[agent].append([key, n])
                if tool:
                    threads[agent].append([f"{key}/tool", int(loguniform(rng, 50, 800))])
            handoff = (key, n)
            agent = pick(rng, trans[agent])
    tb.write(out / f"pareto-tools-h{seed}.jsonl", graph_of(agents, edges, [orch]))


# ---------------------------------------------------------------------------------------------
# e. think-time: chat assistant, long user think times, half the sessions abandoned
# ---------------------------------------------------------------------------------------------


def think_time(seed: int, out: Path) -> None:
    rng = random.Random(f"think-time/{seed}")
    main, helpers = "tt.assistant", ["tt.coder", "tt.search"]
    agents = [main, *helpers]
    anchor = {main: rng.randint(1500, 3000), "tt.coder": rng.randint(600, 1500), "tt.search": rng.randint(300, 900)}
    n_sessions, rate = 56, 0.05
    tb = TapeBuilder(
        "think-time",
        seed,
        {
            "sessions": n_sessions,
            "rate": rate,
            "anchors": anchor,
            "think_s": [10, 240],
            "turns": [3, 12],
            "abandon": 0.5,
            "arrivals": "poisson",
        },
    )
    edges = {(main, h) for h in helpers} | {(h, main) for h in helpers} | {(main, main)}
    for i, start in enumerate(poisson_starts(rng, n_sessions, rate)):
        s = tb.session(f"tt-{seed}-{i:03d}", start)
        turns = rng.randint(3, 12)
        abandoned = rng.random() < 0.5
        if abandoned:
            turns = max(1, round(turns * rng.uniform(0.3, 0.9)))
        convo: list = []
        for u in range(turns):
            convo.append([f"{s.sid}/user{u}", int(loguniform(rng, 50, 600))])
            think = loguniform(rng, 10, 240)
            last = u == turns - 1
            s.dispatch(main)
            helper = rng.random() < 0.3
            key, n = s.call(
                [[f"anchor/{main}", anchor[main]], *convo],
                rng.randint(20, 120) if helper else rng.randint(60, 400),
                0.3 if helper else (0.0 if last else think),
            )
            if helper:
                h = rng.choice(helpers)
                s.dispatch(h)
                hkey, _hn = s.call(
                    [[f"anchor/{h}", anchor[h]], [key, n]], rng.randint(40, 250), loguniform(rng, 0.5, 8)
                )
                s.dispatch(main)
                convo_h = [*convo, [key, n], [f"{hkey}/result", rng.randint(100, 800)]]
                key, n = s.call(
                    [[f"anchor/{main}", anchor[main]], *convo_h], rng.randint(60, 400), 0.0 if last else think
                )
                convo = convo_h
            convo.append([key, n])
        if abandoned:
            s.abandon()
    tb.write(out / f"think-time-h{seed}.jsonl", graph_of(agents, edges, [main]))


# ---------------------------------------------------------------------------------------------
# f. fanout: planner -> 3-6 parallel workers (same step) -> reducer, 1-3 rounds
# ---------------------------------------------------------------------------------------------


def fanout(seed: int, out: Path) -> None:
    rng = random.Random(f"fanout/{seed}")
    planner, reducer = "fo.planner", "fo.reducer"
    workers = [f"fo.worker{i}" for i in range(6)]
    agents = [planner, *workers, reducer]
    anchor = {planner: rng.randint(1000, 2000), reducer: rng.randint(600, 1200)}
    for w in workers:
        anchor[w] = rng.randint(400, 1500)
    n_sessions, rate = 50, 0.07
    edges = {(planner, w) for w in workers} | {(w, reducer) for w in workers} | {(reducer, planner)}
    tb = TapeBuilder(
        "fanout",
        seed,
        {
            "sessions": n_sessions,
            "rate": rate,
            "anchors": anchor,
            "fanout": [3, 6],
            "rounds": [1, 3],
            "arrivals": "poisson",
        },
    )
    for i, start in enumerate(poisson_starts(rng, n_sessions, rate)):
        s = tb.session(f"fo-{seed}-{i:03d}", start)
        task = [f"{s.sid}/task", rng.randint(150, 700)]
        pthread = [task]
        for _rnd in range(rng.randint(1, 3)):
            s.dispatch(planner)
            pkey, pn = s.call([[f"anchor/{planner}", anchor[planner]], *pthread], rng.randint(100, 400), 0.0)
            pthread.append([pkey, pn])
            k = rng.randint(3, 6)
            chosen = rng.sample(workers, k)
            s.dispatch(chosen[0])  # one step for the whole fan-out
            t0, ends, outs = s.t, [], []
            for j, w in enumerate(chosen):
                s.current = w
                sub = [f"{pkey}/sub{j}", rng.randint(50, 250)]
                tool = rng.random() < 0.5
                o = rng.randint(80, 400)
                prompt = [[f"anchor/{w}", anchor[w]], task, [pkey, pn], sub]
                if tool:  # the worker's single tool result is inside its prompt (retrieved before the call)
                    prompt.append([f"{pkey}/sub{j}/tool", rng.randint(100, 800)])
                key, n = s.call(prompt, o, 0.0, t=t0 + 0.002 * j, advance=False)
                ends.append(s.end)
                outs.append([key, n])
            s.t = max(ends) + 0.3
            s.dispatch(reducer)  # parent: the last worker of the fan-out (the previous request)
            rkey, rn = s.call(
                [[f"anchor/{reducer}", anchor[reducer]], task, [pkey, pn], *outs], rng.randint(100, 400), 0.3
            )
            pthread.append([rkey, rn])
    tb.write(out / f"fanout-h{seed}.jsonl", graph_of(agents, edges, [planner]))


# ---------------------------------------------------------------------------------------------
# g. rag-long: small anchors, 2000-5000 retrieved tokens per turn, documents shared across sessions
# ---------------------------------------------------------------------------------------------


def rag_long(seed: int, out: Path) -> None:
    rng = random.Random(f"rag-long/{seed}")
    rewriter, answer, verify, summ = "rag.rewriter", "rag.answer", "rag.verify", "rag.summarize"
    agents = [rewriter, answer, verify, summ]
    anchor = {a: rng.randint(150, 300) for a in agents}
    n_docs = 400
    doc_len = {d: rng.randint(400, 1500) for d in range(n_docs)}
    zipf = [1.0 / (d + 1) ** 1.1 for d in range(n_docs)]
    n_sessions, rate = 36, 0.045
    edges = {
        (rewriter, answer),
        (answer, verify),
        (verify, rewriter),
        (answer, rewriter),
        (answer, summ),
        (verify, summ),
        (verify, answer),
    }
    tb = TapeBuilder(
        "rag-long",
        seed,
        {
            "sessions": n_sessions,
            "rate": rate,
            "anchors": anchor,
            "docs": n_docs,
            "doc_zipf": 1.1,
            "retrieved_per_turn": [2000, 5000],
            "turns": [2, 5],
            "arrivals": "poisson",
        },
    )

    def retrieve(budget: int) -> list:
        docs, total = [], 0
        while total < budget:
            d = rng.choices(range(n_docs), weights=zipf)[0]
            if d in docs:
                continue
            docs.append(d)
            total += doc_len[d]
        if total > 5000 and len(docs) > 1:
            docs.pop()
        return [[f"doc/{d}", doc_len[d]] for d in docs]

    for i, start in enumerate(poisson_starts(rng, n_sessions, rate)):
        s = tb.session(f"rag-{seed}-{i:03d}", start)
        qa: list = []  # the conversation without documents
        ctx: list = []  # documents + conversation (the answerer's context)
        turns = rng.randint(2, 5)
        for u in range(turns):
            q = [f"{s.sid}/q{u}", rng.randint(50, 300)]
            qa.append(q)
            s.dispatch(rewriter)
            _rkey, _rn = s.call(
                [[f"anchor/{rewriter}", anchor[rewriter]], *qa], rng.randint(20, 80), loguniform(rng, 0.3, 2.5)
            )
            docs = retrieve(rng.randint(2000, 5000))
            ctx = ctx + docs + [q]
            s.dispatch(answer)
            last = u == turns - 1
            do_verify = rng.random() < 0.5
            think = loguniform(rng, 8, 90)
            akey, an = s.call(
                [[f"anchor/{answer}", anchor[answer]], *ctx],
                rng.randint(120, 400),
                0.3 if (do_verify or last) else think,
            )
            if do_verify:
                s.dispatch(verify)
                _vkey, _vn = s.call(
                    [[f"anchor/{verify}", anchor[verify]], *docs, q, [akey, an]],
                    rng.randint(20, 100),
                    0.3 if last else think,
                )
            ctx.append([akey, an])
            qa.append([akey, an])
        if rng.random() < 0.6:
            s.dispatch(summ)
            s.call([[f"anchor/{summ}", anchor[summ]], *qa], rng.randint(80, 300), 0.0)
    tb.write(out / f"rag-long-h{seed}.jsonl", graph_of(agents, edges, [rewriter]))


GENERATORS = {
    "groupchat": groupchat,
    "common-preamble": common_preamble,
    "big-teams": big_teams,
    "pareto-tools": pareto_tools,
    "think-time": think_time,
    "fanout": fanout,
    "rag-long": rag_long,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / ".build" / "holdout" / "tapes"))
    ap.add_argument("--seeds", default="0,1")
    args = ap.parse_args()
    out = Path(args.out)
    seeds = [int(x) for x in args.seeds.split(",")]
    for _name, gen in GENERATORS.items():
        for seed in seeds:
            gen(seed, out)
    from agentkv.bench.tape.format import read_tape  # validate what was written

    for path in sorted(out.glob("*.jsonl")):
        tape = read_tape(path)
        check(tape)
        s = tape.summary()
        print(
            f"{tape.name:22s} req={s['requests']:4d} sess={s['sessions']:3d} disp={s['dispatches']:4d} "
            f"anchor={s['anchor_share']:.2f} R={s['predictability']:.2f} maxreq={s['max_request_tokens']:6d} "
            f"dur={s['duration_s']:7.1f} aband={s['abandoned_sessions']} prompt_tok={s['prompt_tokens']}"
        )
    return 0


def check(tape) -> None:
    """Own invariants: outputs referenced with their exact length, parents = previous dispatch's agent."""
    outputs = {r.output_key: r.output_tokens for r in tape.requests}
    seen_out: set[str] = set()
    prev: dict[str, tuple[int, str, str]] = {}  # session -> (step, agent, parent of that step)
    for r in tape.requests:
        for k, n in r.segments:
            if k in outputs:
                assert n == outputs[k], (r.id, k)
                assert k in seen_out, (r.id, k, "output used before its request")
        seen_out.add(r.output_key)
        if r.session not in prev:
            assert r.parent == "" and r.step == 0, r.id
        else:
            step, agent, parent = prev[r.session]
            assert r.step >= step, r.id
            if r.step == step:
                assert r.parent == parent, (r.id, r.parent, parent)
            else:
                assert r.parent == agent, (r.id, r.parent, agent)
        prev[r.session] = (r.step, r.agent, r.parent)


if __name__ == "__main__":
    sys.exit(main())
