"""The one test kit: what kvscope's tests and benches build on.

Synthetic runs with a known truth written like a real run (`synthetic`, `synthetic_write`),
small runs built in memory (`memory_runs`), a real OTLP collector and polling helpers
(`tracing`), a user's own vLLM server (`user_server`), a real LMCache engine around the disk
backend (`lmcache_harness`) and `kvscope run` driven for the live backend tests
(`live_backend`). It sits above both sides (it may import any room) and no room imports it.
"""
