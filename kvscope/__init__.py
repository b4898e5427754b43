"""kvscope: see and fix the KV-cache read path behind an LLM server's time-to-first-token."""

__version__ = "0.1.0"
