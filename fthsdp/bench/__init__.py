"""Benchmarks (`fthsdp bench ...`), the baselines they measure against, and their analysis. Harness, not product."""
