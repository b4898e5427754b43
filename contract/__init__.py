"""The run-directory contract: the one thing producers and readers share.

Producers (the workload driver, tracer, probes, disk backend) write a run directory; readers
(analysis, dashboards, exports) only read it. Both import this package and never each other,
so everything they must agree on is defined here once: the layout and table schemas
(`rundir`), span names and attribute keys (`semconv`), the disk backend's counter names
(`counters`), the clock (`clock`), the environment variables that carry the run to the server
(`env`) and the manifest's host blocks (`host`); and how any of them writes and reads files
on a shared host (`files`, `jsonfiles`). It imports nothing else of kvscope.
"""
