"""Component ids, defined once and shared by the layout (pages/) and the callbacks."""

RUNS = "runs-checklist"  # which loaded runs the views show
PHASE = "phase-choice"  # restrict the TTFT views to the cold phases (default), one phase or all
SORT = "sort-dropdown"  # order of the per-request bars

BREAKDOWN_GRAPH = "breakdown-graph"  # stacked TTFT components per request
CONCURRENCY_GRAPH = "concurrency-graph"  # mean components per concurrency level
PERCENTILE_GRAPH = "percentile-graph"  # p50/p90/p99, one panel per component
THROUGHPUT_GRAPH = "throughput-graph"  # requests/s and tokens/s per phase
FINDINGS = "findings-table"  # analysis findings ("why"), per run
VIEW_TABS = "view-tabs"  # which summary, chunk or device view is drawn (one at a time)

REQUEST = "request-dropdown"  # the request whose waterfall is shown
WATERFALL_GRAPH = "waterfall-graph"  # spans, block I/Os and device depth of one request
WATERFALL_PREFETCH = "waterfall-prefetch"  # a Store the hover prefetch writes nothing to
JAEGER_LINK = "jaeger-link"  # open the request's trace in Jaeger (when configured)
REQUEST_DETAILS = "request-details"  # the request's breakdown as text

DEVICE_GRAPH = "device-graph"  # device queue depth and read bandwidth over time
NVME_GRAPH = "nvme-graph"  # per hardware queue view (runs with nvme_io only)

DOWNLOAD_TABLE = "download-table-dropdown"  # which shown table to download
DOWNLOAD_BUTTON = "download-button"
DOWNLOAD = "download"

CHUNK_TABLE = "chunk-table"  # per-tier hit rates and miss reasons of the selection
CHUNK_REASONS_GRAPH = "chunk-reasons-graph"  # tokens per tier / miss reason over time, per run
CHUNK_STRIP_GRAPH = "chunk-strip-graph"  # the selected request's chunks, hit by tier or missed why
