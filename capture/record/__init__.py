"""`kvscope record`: a run directory made from a vLLM server kvscope did not start."""
