"""``fthsdp chaos --sim``: the membership protocol in a deterministic simulation (docs/chaos.md, "Simulation").

One process, simulated time and network, every choice drawn from one seed: the real lighthouse decision code
(``lighthouse.membership``, the incarnation check, the state document and the in-memory store) drives simulated
replica groups through kills, hangs, partitions, late, lost and duplicated messages and lighthouse restarts;
``checks`` judge each run's history against the invariants the membership layer carries."""
