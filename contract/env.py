"""Environment variables through which `kvscope run` hands the run to the server's processes.

They cross a process boundary (vLLM's API server, engine core and workers read them), so the
driver that sets them and the tracer / backend that read them must spell them the same.
"""

ENV_TRACING = "KVSCOPE_TRACING"  # "1": the tracing plugin instruments each vLLM process
TRACING_PLUGIN = "kvscope_tracing"  # the tracing plugin's vllm.general_plugins entry-point name
ENV_SPANS_DIR = "KVSCOPE_SPANS_DIR"  # where each process writes its OTLP JSON span files
ENV_EXPORTER = "KVSCOPE_EXPORTER"  # the server's exporter process: its abstract socket's name
ENV_CLOCK_OFFSET = "KVSCOPE_CLOCK_OFFSET_NS"  # the run's epoch - monotonic offset (contract.clock)
ENV_BACKEND_STATS_DIR = "KVSCOPE_BACKEND_STATS_DIR"  # where the disk backend writes its counters
ENV_FP32_GEMM = "KVSCOPE_FP32_GEMM"  # "1": bf16 linear layers computed in fp32 (vllm_cpu.fp32_gemm)
