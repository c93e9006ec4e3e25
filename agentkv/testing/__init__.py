"""Test helpers for agentkv: a download-free tiny model and a real vLLM server manager."""
