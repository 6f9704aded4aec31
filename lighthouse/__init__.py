"""The lighthouse: membership of a job's replicas in epochs, over gRPC (see DESIGN §4)."""
