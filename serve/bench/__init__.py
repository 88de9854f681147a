"""Benchmarks users choose configurations from: decode speed, serving load, memory; baselines in the same run."""
