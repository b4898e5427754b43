"""The capture room: what makes a run directory from the outside world.

`workload` drives a live vLLM + LMCache server through its phases (`kvscope run`), `record`
attaches to a server someone else started (`kvscope record`), `trace_import` turns traces from
Jaeger or a Collector into a run (`kvscope import`); `twins` makes the model twins the workload
serves and `ceiling` measures the disk every run is judged against.
"""
