"""Readers that turn a run's spans into files other tools open: Jaeger's UI, Perfetto."""
