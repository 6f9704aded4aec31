"""What tests and benchmarks share: the local launcher, process helpers, fault hooks, invariants. Harness."""
