"""Non-blocking catch-up: healthy replicas serve a snapshot taken at a commit boundary; a joining replica fetches
it (raw tensor bytes, checksummed, from several sources at once) while the others keep training."""
