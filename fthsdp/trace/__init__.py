"""``fthsdp trace``: one timeline of a whole job (docs/design.md §8, "Seeing inside a replica"). ``pull`` reads every
rank's step timeline over its catch-up port (authenticated, on demand), ``chrome`` merges them with the lighthouse's
epochs into a Chrome trace-event document (Perfetto, ``chrome://tracing``), ``render`` draws it as a PNG."""
