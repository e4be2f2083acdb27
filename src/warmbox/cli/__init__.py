"""The warmbox command line."""
