"""The `shardshift` command line."""
