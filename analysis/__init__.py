"""TTFT attribution from a run directory: pandas in, pandas out."""
