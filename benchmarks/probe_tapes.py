"""Four more workload shapes (format version 1), written in session 15 to look for workloads on
which ``agentkv`` does no better than LRU. Not a tuning set; one of them found a gap, since fixed
(sessions of one call each, ``oneshot``: docs/benchmarks.md, "Sessions of one call each"). Four
workloads x seeds {0, 1} -> OUT/<name>-p<seed>.jsonl:

    .venv/bin/python benchmarks/probe_tapes.py [--out .build/probe/tapes]
    .venv/bin/python -m agentkv bench replay .build/probe/tapes/*.jsonl \
        --policies lru,agentkv,agentkv-untagged,agentkv+warmup,kvflow,belady --out .build/probe

* ``longtail``: a router and 40 specialists picked by Zipf popularity (anchors 300-2,000 tokens).
* ``mixed``: a chat app (user think time 5-120 s) and a four-agent pipeline on one server.
* ``oneshot``: ten agents called independently (every call a session of its own), popularity
  halving every two agents, bursty arrivals.
* ``deep``: three agents, sessions of 20-50 dispatches whose history outgrows the cache.

Timing and the tape writer are ``holdout_tapes.py``'s.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from holdout_tapes import (
    TapeBuilder,
    bursty_starts,
    complete_graph,
    graph_of,
    loguniform,
    pick,
    poisson_starts,
)


def longtail(seed, out):
    rng = random.Random(f"longtail/{seed}")
    router = "lt.router"
    specs = [f"lt.spec{i:02d}" for i in range(40)]
    anchor = {router: rng.randint(800, 1500), **{s: rng.randint(300, 2000) for s in specs}}
    w = {s: 1.0 / (i + 1) ** 1.0 for i, s in enumerate(specs)}
    tb = TapeBuilder("longtail", seed, {"sessions": 80, "rate": 0.25, "specialists": 40, "zipf": 1.0}, "p")
    for i, start in enumerate(poisson_starts(rng, 80, 0.25)):
        s = tb.session(f"lt-{seed}-{i:03d}", start)
        convo = [[f"{s.sid}/task", rng.randint(100, 400)]]
        for _d in range(rng.randint(2, 6)):
            s.dispatch(router)
            k, n = s.call([[f"anchor/{router}", anchor[router]], *convo], rng.randint(20, 60), 0.2)
            convo.append([k, n])
            sp = pick(rng, w)
            s.dispatch(sp)
            k, n = s.call([[f"anchor/{sp}", anchor[sp]], *convo], rng.randint(80, 300), loguniform(rng, 0.3, 5))
            convo.append([k, n])
    edges = {(router, s) for s in specs} | {(s, router) for s in specs}
    tb.write(out / f"longtail-p{seed}.jsonl", graph_of([router, *specs], edges, [router]))


def mixed(seed, out):
    rng = random.Random(f"mixed/{seed}")
    chat = "mx.chat"
    pipe = [f"mx.p{i}" for i in range(4)]
    anchor = {chat: rng.randint(1000, 2500), **{p: rng.randint(400, 1200) for p in pipe}}
    tb = TapeBuilder("mixed", seed, {"chat_sessions": 30, "chat_rate": 0.05, "think_s": [5, 120],
                                     "pipeline_sessions": 60, "pipeline_rate": 0.1}, "p")
    for i, start in enumerate(poisson_starts(rng, 30, 0.05)):
        s = tb.session(f"mc-{seed}-{i:03d}", start)
        convo = []
        turns = rng.randint(3, 15)
        for u in range(turns):
            convo.append([f"{s.sid}/u{u}", rng.randint(30, 300)])
            s.dispatch(chat)
            think = 0.0 if u == turns - 1 else loguniform(rng, 5, 120)
            k, n = s.call([[f"anchor/{chat}", anchor[chat]], *convo], rng.randint(50, 400), think)
            convo.append([k, n])
    for i, start in enumerate(poisson_starts(rng, 60, 0.1)):
        s = tb.session(f"mp-{seed}-{i:03d}", start)
        ctx = [[f"{s.sid}/in", rng.randint(100, 600)]]
        for p in pipe:
            s.dispatch(p)
            k, n = s.call([[f"anchor/{p}", anchor[p]], *ctx], rng.randint(50, 200), 0.3)
            ctx.append([k, n])
    edges = {(chat, chat)} | {(pipe[j], pipe[j + 1]) for j in range(3)}
    tb.write(out / f"mixed-p{seed}.jsonl", graph_of([chat, *pipe], edges, [chat, pipe[0]]))


def oneshot(seed, out):
    rng = random.Random(f"oneshot/{seed}")
    agents = [f"os.a{i}" for i in range(10)]
    anchor = {a: rng.randint(500, 2500) for a in agents}
    w = {a: 2.0 ** -(i / 2) for i, a in enumerate(agents)}
    tb = TapeBuilder("oneshot", seed, {"calls": 400, "agents": 10, "popularity": "2^(-i/2)", "arrivals": "bursty"},
                     "p")
    for i, start in enumerate(bursty_starts(rng, 400, 0.3, (1, 8), 2.0)):
        s = tb.session(f"os-{seed}-{i:04d}", start)
        a = pick(rng, w)
        s.dispatch(a)
        s.call([[f"anchor/{a}", anchor[a]], [f"{s.sid}/q", rng.randint(50, 800)]], rng.randint(20, 200), 0.0)
    tb.write(out / f"oneshot-p{seed}.jsonl", graph_of(agents, set(), agents))


def deep(seed, out):
    rng = random.Random(f"deep/{seed}")
    agents = ["dp.plan", "dp.act", "dp.check"]
    anchor = {a: rng.randint(400, 1000) for a in agents}
    tb = TapeBuilder("deep", seed, {"sessions": 12, "rate": 0.02, "dispatches": [20, 50]}, "p")
    for i, start in enumerate(poisson_starts(rng, 12, 0.02)):
        s = tb.session(f"dp-{seed}-{i:03d}", start)
        convo = [[f"{s.sid}/goal", 300]]
        for d in range(rng.randint(20, 50)):
            a = agents[d % 3] if rng.random() < 0.8 else rng.choice(agents)
            s.dispatch(a)
            k, n = s.call([[f"anchor/{a}", anchor[a]], *convo], rng.randint(30, 150), loguniform(rng, 0.5, 10))
            convo.append([k, n])
    tb.write(out / f"deep-p{seed}.jsonl", complete_graph(agents, ["dp.plan"], True))


GENERATORS = {"longtail": longtail, "mixed": mixed, "oneshot": oneshot, "deep": deep}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".build/probe/tapes"))
    args = parser.parse_args()
    for seed in (0, 1):
        for generate in GENERATORS.values():
            generate(seed, args.out)
    print(f"wrote {2 * len(GENERATORS)} tapes to {args.out}")


if __name__ == "__main__":
    main()
