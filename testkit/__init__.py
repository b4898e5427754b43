"""Test kit: run directories with a known truth, written through the contract (tests, benches)."""
