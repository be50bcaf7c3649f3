"""OpenForge: reinforcement learning for LLM agents inside the harnesses they run in."""

__version__ = "0.1.0"
