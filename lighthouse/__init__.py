"""The lighthouse: membership of a job's replicas in epochs, over gRPC (see docs/design.md §4)."""
