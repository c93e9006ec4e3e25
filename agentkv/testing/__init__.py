"""Test helpers for agentkv: a download-free tiny model, a real vLLM server manager, and what the
examples share around their app (:mod:`agentkv.testing.example_cli`)."""
