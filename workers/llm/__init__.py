"""The LLM worker: an engine (workers/engine) in the worker shell, and the prefill→decode handoff."""
