"""Seeded chaos runs (`fthsdp chaos`): local clusters under a schedule of failures, invariants checked. Harness."""
