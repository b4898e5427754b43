"""The run-directory contract: the one thing producers and readers share.

Producers (the workload driver, tracer, probes, disk backend) write a run directory; readers
(analysis, dashboards, exports) only read it. Both import this package and never each other,
so everything they must agree on is defined here once: the layout and table schemas
(`rundir`), span names, attribute keys and their value types (`semconv`), the span files'
format (`otlp_json`), the disk backend's counter names (`counters`), the chunk ledger's tiers
and miss reasons (`chunk_outcomes`), the parts of vLLM and LMCache kvscope reaches
(`upstream`), the clock (`clock`), the environment variables that carry the run to the server
(`env`), the manifest's host blocks (`host`), the device ceiling's record (`ceiling`) and the
parts profiles play in a study (`study_roles`); and how any of them writes and reads files on
a shared host (`files`, `jsonfiles`). It imports nothing else of kvscope.
"""
