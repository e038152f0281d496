"""The engineer's command line."""
