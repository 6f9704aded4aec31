"""Launching a job on one host: a lighthouse and the replica groups (one torchrun each), restarts, warm standbys,
the progress files and the end-of-run report. ``fthsdp run`` and ``fthsdp demo`` are built on it
(``cluster.Cluster``, ``config.ClusterConfig``); so are the benchmarks and the integration tests. Product code: it
never imports the test harness (``fthsdp.testing``) or the benchmarks."""
