"""Framework adapters (LangGraph, AutoGen, plain OpenAI SDK)."""
