"""``fthsdp chaos --sim``: the control plane in a deterministic simulation (docs/chaos.md, "Simulation").

One process, simulated time and network, every choice drawn from one seed: the real decision code (the
lighthouse's ``lighthouse.membership`` with the incarnation check, the state document and the in-memory store;
FTAR's ``ftar.rules`` and ``ftar.reconcile``; the runtime's ``fthsdp.runtime.commit``) drives simulated replica
groups, their lanes (``lanes``) and their training loops (``trainer``) through kills (mid-exchange too), hangs,
partitions, late, lost and duplicated messages and lighthouse restarts; ``checks`` judge each run's history
against the invariants."""
