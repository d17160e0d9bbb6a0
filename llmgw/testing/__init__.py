"""Helpers that tests and benchmarks import: the fake engine and the tiny model writer."""
