"""What tests and benchmarks share: the local launcher (``launcher``), process and port helpers (``procutil``,
``ports``), a lighthouse child process (``lighthouse_process``), real etcd on loopback (``etcd``), fault hooks
(``faults``), the typed progress rows (``progress``) and the invariant checks over a run (``invariants``). Harness."""
