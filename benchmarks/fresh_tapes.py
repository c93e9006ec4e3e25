"""Five more multi-agent workloads, written apart (session 35): a check, not a tuning set.

Written by a helper from the tape format (docs/tapes.md) alone, without reading the project's
generators or model, with its parameters fixed before any replay; nothing was tuned on them
(docs/benchmarks.md, "Five more shapes, written apart"). Standard library only; deterministic
(``random.Random`` seeded by "<workload>:<seed>"). Five workloads x seeds {1, 2} ->
OUT/<workload>-s<seed>.jsonl:

    .venv/bin/python benchmarks/fresh_tapes.py [--out .build/fresh-tapes] [WORKLOAD ...]
    .venv/bin/python -m agentkv bench replay .build/fresh-tapes/*.jsonl \
        --policies lru,agentkv,kvflow,belady --jobs 2 --out .build/fresh-replay

supervisor (a supervisor picks the next of 8 workers, each session with its own 2-3 favourites),
reflection (generator <-> critic rounds, then a summarizer; long outputs), mixed-tenants (a
3-agent pipeline, a 10-agent planner/workers app and a one-agent chat whose users think 20-200 s
and 40% of whom leave without notice, on one server), bursty (bursts of 30 sessions in 20 s, then
3-minute lulls; tool calls of 1-30 s), long-sessions (3-5 concurrent sessions of 60-120
dispatches: history dominates).

Prompt model: [shared app preamble] + anchor/<app>/<agent> + the session's history (task,
every earlier output, tool results, user turns), so an agent's earlier prompt is an exact
prefix of its later prompts in the same session. Times use the replay's no-hit service model
(5 ms + prompt/10,000 s + 10 ms per output token); tool, think and hand-off time goes in tool_gap.
"""
import argparse
import json
import math
import os
import random

OUT = ".build/fresh-tapes"
HANDOFF = 0.3


def service(prompt, out):
    return 0.005 + prompt / 10000.0 + 0.01 * out


def loguni(rng, lo, hi):
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def poisson_times(rng, rate, n, t0=0.0):
    t, ts = t0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        ts.append(t)
    return ts


class Tape:
    def __init__(self, name, seed, params):
        self.name, self.seed, self.params = name, seed, params
        self.reqs = []          # (t, seq, dict)
        self.prefix = {}        # agent -> list of anchor segments
        self.nodes, self.edges, self.entry = [], set(), set()
        self.sessions = 0
        self.abandoned = 0

    def agent(self, name, segs):
        self.prefix[name] = segs
        self.nodes.append(name)

    def write(self):
        self.reqs.sort(key=lambda r: (r[0], r[1]))
        anchor = total = 0
        largest = 0
        for _, _, r in self.reqs:
            n = sum(x[1] for x in r["segments"])
            a = sum(x[1] for x in r["segments"] if x[0].startswith("anchor/"))
            anchor += a
            total += n
            largest = max(largest, n + r["output_tokens"])
        header = {
            "format": "agentkv-tape", "version": 1, "block_size": 16,
            "name": f"{self.name}-s{self.seed}", "seed": self.seed,
            "workload": dict(self.params, topology=self.name, generator="benchmarks/fresh_tapes.py"),
            "graph": {"nodes": self.nodes, "edges": sorted([list(e) for e in self.edges]),
                      "entry": sorted(self.entry)},
            "summary": {"requests": len(self.reqs), "sessions": self.sessions,
                        "abandoned_sessions": self.abandoned,
                        "anchor_share": round(anchor / total, 4), "prompt_tokens": total,
                        "largest_request_tokens": largest,
                        "duration_s": round(self.reqs[-1][0], 1)},
        }
        path = os.path.join(OUT, f"{self.name}-s{self.seed}.jsonl")
        with open(path, "w") as f:
            f.write(json.dumps(header) + "\n")
            for t, _, r in self.reqs:
                r["t"] = round(t, 4)
                f.write(json.dumps(r, separators=(",", ":")) + "\n")
        # mean number of sessions in flight
        span = {}
        for t, _, r in self.reqs:
            s = span.setdefault(r["session"], [t, t])
            s[1] = t
        busy = sum(b - a for a, b in span.values())
        print(f"{header['name']:22s} sessions {self.sessions:4d} requests {len(self.reqs):5d} "
              f"anchor share {anchor/total:5.1%} largest {largest:6d} tok  duration {self.reqs[-1][0]:7.0f} s "
              f"mean concurrent sessions {busy/self.reqs[-1][0]:5.1f}  abandoned {self.abandoned}")
        return path


class Session:
    """One conversation
    history only grows."""

    def __init__(self, tape, sid, t0, rng, task_tokens):
        self.tape, self.sid, self.t, self.rng = tape, sid, t0, rng
        self.history = [[f"{sid}/task", task_tokens]]
        self.k = 0
        self.step = -1
        self.prev_dispatch_agent = ""
        self.cur_agent = None
        tape.sessions += 1

    def dispatch(self, agent):
        """Start a new dispatch step of `agent` (returns parent)."""
        if self.cur_agent is not None:
            self.tape.edges.add((self.cur_agent, agent))
        else:
            self.tape.entry.add(agent)
        self.prev_dispatch_agent = self.cur_agent or ""
        self.cur_agent = agent
        self.step += 1

    def call(self, out_tokens, gap, tool_tokens=0, user_tokens=0):
        """One LLM request of the current dispatch's agent
        then `gap` s
        then append tool
        result / next user message to the history."""
        agent = self.cur_agent
        segs = [list(s) for s in self.tape.prefix[agent]] + [list(h) for h in self.history]
        rid = f"{self.sid}/c{self.k}"
        req = {"t": self.t, "session": self.sid, "agent": agent,
               "parent": self.prev_dispatch_agent, "segments": segs,
               "output_tokens": int(out_tokens), "tool_gap": round(gap, 3),
               "id": rid, "step": self.step, "output": f"{rid}/out"}
        self.tape.reqs.append((self.t, len(self.tape.reqs), req))
        prompt = sum(s[1] for s in segs)
        self.history.append([f"{rid}/out", int(out_tokens)])
        if tool_tokens:
            self.history.append([f"{rid}/tool", int(tool_tokens)])
        if user_tokens:
            self.history.append([f"{rid}/user", int(user_tokens)])
        self.t += service(prompt, out_tokens) + gap
        self.k += 1
        return req


def anchors(tape, rng, app, agents, lo=500, hi=3000, preamble=None):
    pre = [[f"anchor/{app}/org", preamble]] if preamble else []
    for a in agents:
        tape.agent(a, [*pre, [f"anchor/{a}", int(loguni(rng, lo, hi))]])


def pick(rng, weights):
    keys = list(weights)
    return rng.choices(keys, [weights[k] for k in keys])[0]


# 1. supervisor ---------------------------------------------------------------------------
def supervisor(seed):
    rng = random.Random(f"supervisor:{seed}")
    n_sess, rate = 52, 0.06
    tape = Tape("supervisor", seed, {"sessions": n_sess, "rate": rate, "workers": 8,
                                     "dispatches": [8, 30], "favourites": [2, 3]})
    sup = "sv.supervisor"
    workers = [f"sv.{w}" for w in ("search", "browse", "code", "test", "sql", "docs", "math", "write")]
    anchors(tape, rng, "sv", [sup, *workers], preamble=180)
    base = {w: loguni(rng, 0.5, 2.0) for w in workers}            # global popularity
    tool_p = {w: rng.uniform(0.3, 0.9) for w in workers}
    tool_med = {w: loguni(rng, 1.5, 6.0) for w in workers}
    for i, t0 in enumerate(poisson_times(rng, rate, n_sess)):
        s = Session(tape, f"sv{i}", t0, rng, rng.randint(120, 400))
        tape.edges.update((sup, x) for x in workers)
        tape.edges.update((x, sup) for x in workers)
        fav = rng.sample(workers, rng.randint(2, 3))
        fav_mass = rng.uniform(0.6, 0.85)
        fw = [rng.random() + 0.3 for _ in fav]
        w = {x: (1 - fav_mass) * base[x] / sum(base[y] for y in workers if y not in fav)
             for x in workers if x not in fav}
        for x, q in zip(fav, fw, strict=False):
            w[x] = fav_mass * q / sum(fw)
        for _d in range(rng.randint(8, 30)):
            s.dispatch(sup)
            s.call(rng.randint(30, 120), HANDOFF)
            wk = pick(rng, w)
            s.dispatch(wk)
            if rng.random() < tool_p[wk]:
                gap = min(30.0, tool_med[wk] * math.exp(rng.gauss(0, 0.8)))
                s.call(rng.randint(60, 250), gap, tool_tokens=rng.randint(80, 600))
            else:
                s.call(rng.randint(120, 450), HANDOFF)
        s.dispatch(sup)
        s.call(rng.randint(150, 400), 0)
    return tape


# 2. reflection ---------------------------------------------------------------------------
def reflection(seed):
    rng = random.Random(f"reflection:{seed}")
    n_sess, rate = 230, 0.45
    tape = Tape("reflection", seed, {"sessions": n_sess, "rate": rate, "rounds": [2, 6]})
    gen, crit, summ = "rf.generator", "rf.critic", "rf.summarizer"
    anchors(tape, rng, "rf", [gen, crit, summ], preamble=96)
    tape.edges.update({(gen, crit), (crit, gen), (crit, summ)})
    for i, t0 in enumerate(poisson_times(rng, rate, n_sess)):
        s = Session(tape, f"rf{i}", t0, rng, rng.randint(150, 600))
        for _r in range(rng.randint(2, 6)):
            s.dispatch(gen)
            s.call(rng.randint(500, 1500), HANDOFF)
            s.dispatch(crit)
            s.call(rng.randint(200, 600), HANDOFF)
        s.dispatch(summ)
        s.call(rng.randint(200, 500), 0)
    return tape


# 3. mixed-tenants ------------------------------------------------------------------------
def mixed(seed):
    rng = random.Random(f"mixed-tenants:{seed}")
    T = 1200.0
    p_rate, pl_rate, c_rate = 0.25, 0.012, 0.045
    tape = Tape("mixed-tenants", seed, {"duration": T, "pipeline_rate": p_rate,
                                        "planner_rate": pl_rate, "chat_rate": c_rate,
                                        "chat_think_s": [20, 200], "chat_leave_p": 0.4})
    pipe = ["mt.pipe.ingest", "mt.pipe.analyze", "mt.pipe.respond"]
    planner = "mt.plan.planner"
    pw = [f"mt.plan.w{i}" for i in range(1, 10)]
    chat = "mt.chat.assistant"
    anchors(tape, rng, "mt.pipe", pipe, 500, 1500, preamble=64)
    anchors(tape, rng, "mt.plan", [planner, *pw], 600, 3000, preamble=200)
    anchors(tape, rng, "mt.chat", [chat], 1500, 3000)
    # pipeline: short sessions, fast arrivals
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(p_rate)
        if t > T:
            break
        s = Session(tape, f"mp{i}", t, rng, rng.randint(100, 300))
        i += 1
        s.dispatch(pipe[0])
        s.call(rng.randint(40, 120), loguni(rng, 0.5, 4), tool_tokens=rng.randint(200, 800))
        s.dispatch(pipe[1])
        s.call(rng.randint(80, 250), HANDOFF)
        s.dispatch(pipe[2])
        s.call(rng.randint(60, 200), 0)
    # planner / 9 workers: long sessions
    ww = {w: loguni(rng, 0.3, 3.0) for w in pw}
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(pl_rate)
        if t > T:
            break
        s = Session(tape, f"ml{i}", t, rng, rng.randint(200, 500))
        i += 1
        for _d in range(rng.randint(12, 25)):
            s.dispatch(planner)
            s.call(rng.randint(60, 200), HANDOFF)
            wk = pick(rng, ww)
            s.dispatch(wk)
            if rng.random() < 0.6:
                s.call(rng.randint(80, 300), loguni(rng, 1, 15), tool_tokens=rng.randint(100, 500))
            else:
                s.call(rng.randint(150, 400), HANDOFF)
        s.dispatch(planner)
        s.call(rng.randint(200, 500), 0)
    # chat: user think time 20-200 s; 40% leave without notice
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(c_rate)
        if t > T:
            break
        s = Session(tape, f"mc{i}", t, rng, rng.randint(30, 200))
        i += 1
        turns = rng.randint(6, 20)
        leave = rng.random() < 0.4
        if leave:
            turns = max(1, round(turns * rng.uniform(0.2, 0.7)))
        for k in range(turns):
            s.dispatch(chat)
            last = k == turns - 1
            req = s.call(rng.randint(80, 400), 0 if last else rng.uniform(20, 200),
                         user_tokens=0 if last else rng.randint(15, 150))
        if leave:
            req["abandoned"] = True
            tape.abandoned += 1
    tape.edges.add((chat, chat))
    return tape


# 4. bursty ---------------------------------------------------------------------------------
def bursty(seed):
    rng = random.Random(f"bursty:{seed}")
    n_bursts = 4
    tape = Tape("bursty", seed, {"bursts": n_bursts, "burst_rate": 1.5, "burst_s": 20,
                                 "lull_s": 180, "tool_gap_s": [1, 30]})
    ag = [f"bu.{a}" for a in ("router", "retriever", "analyst", "coder", "verifier", "reporter")]
    anchors(tape, rng, "bu", ag, preamble=128)
    # Markov chain (per seed weights)
    chain = {
        ag[0]: {ag[1]: 3, ag[2]: 2, ag[3]: 2},
        ag[1]: {ag[2]: 4, ag[0]: 1, ag[3]: 1},
        ag[2]: {ag[3]: 2, ag[4]: 1, ag[5]: 1, ag[0]: 1},
        ag[3]: {ag[4]: 4, ag[2]: 1},
        ag[4]: {ag[3]: 2, ag[5]: 2, ag[0]: 1},
        ag[5]: {ag[0]: 3, ag[4]: 1},
    }
    for a in chain:
        for b in chain[a]:
            chain[a][b] *= rng.uniform(0.6, 1.6)
    for a in chain:
        tape.edges.update((a, b) for b in chain[a])
    tape.entry.add(ag[0])
    tool_p = {a: rng.uniform(0.2, 0.8) for a in ag}
    tool_p[ag[0]] = 0.1
    t0, i = 0.0, 0
    for _burst in range(n_bursts):
        starts = []
        t = t0
        while True:
            t += rng.expovariate(1.5)
            if t > t0 + 20:
                break
            starts.append(t)
        for st in starts:
            s = Session(tape, f"bu{i}", st, rng, rng.randint(100, 400))
            i += 1
            a = ag[0]
            n = rng.randint(6, 14)
            for d in range(n):
                s.dispatch(a)
                calls = 0
                while True:            # tool loop: same agent, same step
                    calls += 1
                    if calls < 4 and rng.random() < tool_p[a]:
                        s.call(rng.randint(40, 200), loguni(rng, 1, 30), tool_tokens=rng.randint(80, 700))
                    else:
                        s.call(rng.randint(100, 400), HANDOFF if d < n - 1 else 0)
                        break
                a = pick(rng, chain[a])
        t0 += 20 + 180 * rng.uniform(0.8, 1.2)
    return tape


# 5. long-sessions ---------------------------------------------------------------------------
def long_sessions(seed):
    rng = random.Random(f"long-sessions:{seed}")
    n_sess, rate = 19, 1 / 65.0
    tape = Tape("long-sessions", seed, {"sessions": n_sess, "rate": rate, "dispatches": [60, 120]})
    ag = [f"ls.{a}" for a in ("planner", "coder", "tester", "writer")]
    anchors(tape, rng, "ls", ag, preamble=64)
    P, C, Te, W = ag
    chain = {P: {C: 7, W: 2, Te: 1}, C: {Te: 6, P: 2, W: 1}, Te: {C: 6, P: 3, W: 1}, W: {P: 8, Te: 2}}
    for a in chain:
        tape.edges.update((a, b) for b in chain[a])
    tape.entry.add(P)
    tool_p = {P: 0.1, C: 0.5, Te: 0.7, W: 0.1}
    for i, t0 in enumerate(poisson_times(rng, rate, n_sess)):
        s = Session(tape, f"ls{i}", t0, rng, rng.randint(200, 500))
        a = P
        n = rng.randint(60, 120)
        for d in range(n):
            s.dispatch(a)
            if rng.random() < tool_p[a]:
                s.call(rng.randint(40, 150), loguni(rng, 1, 10), tool_tokens=rng.randint(40, 250))
            else:
                s.call(rng.randint(60, 220), HANDOFF if d < n - 1 else 0)
            a = pick(rng, chain[a])
    return tape


WORKLOADS = {"supervisor": supervisor, "reflection": reflection, "mixed-tenants": mixed,
             "bursty": bursty, "long-sessions": long_sessions}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=OUT, help="directory of the tapes (default: %(default)s)")
    parser.add_argument("workloads", nargs="*", metavar="WORKLOAD", help=f"of {', '.join(WORKLOADS)} (default: all)")
    args = parser.parse_args()
    if unknown := set(args.workloads) - set(WORKLOADS):
        parser.error(f"unknown workload(s): {', '.join(sorted(unknown))}")
    OUT = args.out
    os.makedirs(OUT, exist_ok=True)
    for w in args.workloads or list(WORKLOADS):
        for seed in (1, 2):
            WORKLOADS[w](seed).write()
