"""`kvscope import`: a run directory from traces that already sit in a file or a trace backend."""
