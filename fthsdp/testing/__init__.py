"""The test harness that tests, chaos runs and benchmarks share on top of the launcher (``fthsdp.launch``): ports
(``ports``), real etcd on loopback (``etcd``), the invariant checks over a run (``invariants``) and the NCCL
check's report (``nccl_report``). Nothing in the product imports it."""
