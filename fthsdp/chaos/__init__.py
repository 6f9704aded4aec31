"""Chaos runs: a local cluster (``fthsdp.launch.cluster``) under a seeded schedule of failures, then every
invariant of docs/design.md §8 checked over what it left behind (``fthsdp.testing.invariants``).

Failures (``KINDS``):

- ``kill``: SIGKILL of a replica group at a phase of a step (forward, backward, exchange, vote, optimizer), or
  while it serves a catch-up snapshot to a joiner (``serve``: another replica is killed first so that someone
  joins), or while it fetches one (``fetch``: killed once, then again in its next incarnation mid-fetch);
- ``hang``: SIGSTOP of a whole replica group (its torchrun's process group: every rank and the heartbeats stop),
  SIGCONT a few seconds later. The others must declare it dead and go on; once continued it finds itself declared
  dead or behind, exits to rejoin and comes back;
- ``double``: two replica groups SIGKILLed at the same step (different phases);
- ``rank-hang``, ``rank-kill`` (only when asked for): SIGSTOP (for a few seconds) or SIGKILL of one worker of a group
  alone, its siblings and its torchrun agent left alive; the group must end itself and come back;
- ``lighthouse`` (``--ha``): SIGKILL of the leading lighthouse (of 2-3 on a 3-member etcd); another takes over,
  training goes on; the killed one is restarted on its ports a few seconds later and follows;
- ``etcd`` (``--ha``): SIGKILL of one etcd member; the other two keep a quorum; restarted a few seconds later.

A fault is armed only once the previous one is over (every replica active again in the current epoch, every
lighthouse answering) and the job has reached the fault's step: a schedule never kills the last replica by
accident. Kills at a phase go through ``FTHSDP_FAULT_FILE`` (``fthsdp.runtime.faults``): the runner writes
``STEP:PHASE`` into the replica's fault file when it arms the fault; rank 0 of the group SIGKILLs its torchrun when
it gets there.

Modules: ``schedule`` (the pure, seeded fault schedule), ``actions`` (signals to process trees, lighthouse kills),
``cluster`` (the local cluster with fault files and HA lighthouses), ``injector`` (drives a schedule from the
launcher's supervision loop), ``config`` (a run's settings), ``run`` (``run_chaos``: one schedule, its result;
``soak``: successive seeds), ``report`` (their text). Harness.
"""
