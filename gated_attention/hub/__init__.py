"""Hub integration: the remote-code bundle and model cards."""
