"""The `fthsdp` command."""
