"""Chat tapes: one assistant (and a retriever in a fifth of the turns), users who think between turns.

The shape the held-out think-time tapes showed agentkv weak on, drawn with parameters of our own
(not the held-out generator's): think time log-normal, median 30 s, sigma 1, clipped to 3-300 s;
2-15 turns; 60 sessions at 0.05/s. Session 11 tuned the idle-time model on these and the seed-0
zoo (docs/benchmarks.md).

    python benchmarks/chat_tapes.py            # .build/chat/chat-mine-{0,1,2}.jsonl
    agentkv bench replay .build/chat/*.jsonl --policies lru,agentkv,belady
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

ANCHORS = {"chat.assistant": 2000, "chat.retriever": 700}


def tape(seed: int, path: Path) -> None:
    rng = random.Random(f"chat-mine/{seed}")
    header = {"format": "agentkv-tape", "version": 1, "block_size": 16, "name": f"chat-mine-{seed}",
              "graph": {"nodes": list(ANCHORS), "entry": ["chat.assistant"],
                        "edges": [["chat.assistant", "chat.retriever"], ["chat.retriever", "chat.assistant"],
                                  ["chat.assistant", "chat.assistant"]]}}
    requests: list[dict] = []
    t = 0.0
    for i in range(60):
        t += rng.expovariate(0.05)
        sid, history, start, step, parent = f"c{seed}-{i}", [], t, 0, ""
        turns = rng.randint(2, 15)
        abandoned = rng.random() < 0.4
        for u in range(turns):
            history.append([f"{sid}/user{u}", rng.randint(30, 400)])
            last = u == turns - 1
            think = min(300.0, max(3.0, math.exp(math.log(30) + rng.gauss(0, 1.0))))
            if rng.random() < 0.2:
                rid = f"{sid}/r{u}"
                requests.append({"id": rid, "t": start, "session": sid, "agent": "chat.retriever", "parent": parent,
                                 "step": step, "segments": [["anchor/chat.retriever", 700], history[-1]],
                                 "output_tokens": rng.randint(20, 60), "tool_gap": 0.3})
                history.append([f"{rid}/out", requests[-1]["output_tokens"]])
                parent, step, start = "chat.retriever", step + 1, start + 1.5
            aid, out = f"{sid}/a{u}", rng.randint(50, 400)
            requests.append({"id": aid, "t": start, "session": sid, "agent": "chat.assistant", "parent": parent,
                             "step": step, "segments": [["anchor/chat.assistant", 2000], *history],
                             "output_tokens": out, "tool_gap": 0.0 if last else think})
            history.append([f"{aid}/out", out])
            parent, step = "chat.assistant", step + 1
            start += 0.015 + out * 0.01 + think
        if abandoned:
            requests[-1]["abandoned"] = True
    requests.sort(key=lambda r: r["t"])  # a session's later times only order the file: the replay paces it
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for line in [header, *requests]:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    for seed in (0, 1, 2):
        tape(seed, Path(".build/chat") / f"chat-mine-{seed}.jsonl")
