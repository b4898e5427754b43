"""bcc eBPF probes on block and NVMe(-oF) tracepoints: per-I/O queue/service time, in-flight depth."""
