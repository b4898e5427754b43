"""OpenTelemetry spans for every request, from the client through vLLM into the KV read path."""
