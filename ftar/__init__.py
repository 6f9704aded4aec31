"""FTAR: fault-tolerant all-reduce across replicas (see DESIGN §5)."""
