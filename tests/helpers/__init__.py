"""Helpers the unit and integration tests share (in-process lighthouse, etcd, TLS material, workers, checks)."""
