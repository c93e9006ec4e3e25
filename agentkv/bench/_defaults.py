"""Names and defaults shared by the bench modules and their CLI (no heavy imports)."""

from __future__ import annotations

TOPOLOGY_NAMES = ("pipeline", "debate", "selector", "random")  # == topologies.TOPOLOGIES
WORKLOAD_NAMES = (*TOPOLOGY_NAMES, "teams", "multi-app", "heavy-tools", "abandoned")  # == workloads.WORKLOADS
POLICY_NAMES = ("lru", "ttl", "kvflow", "agentkv", "agentkv+facts", "agentkv+warmup", "agentkv-untagged",
                "agentkv-agent-only", "agentkv-agent-only-no-recognition", "belady")  # == policies.POLICIES
DEFAULT_POLICIES = tuple(p for p in POLICY_NAMES if not p.startswith(("agentkv-untagged", "agentkv-agent-only")))
DEFAULT_MULTIPLIERS = (1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)  # x the tape's largest request, in blocks
DEFAULT_MARGIN = 15.0  # preflight: points of token hit rate between belady and lru
# The environment of every vLLM server the benchmarks start (on top of the caller's): the models
# are built locally (no hub), the KV pool is --num-gpu-blocks-override, so a 1 GiB CPU budget
# suffices, and no usage telemetry leaves the machine.
SERVER_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
