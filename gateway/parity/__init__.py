"""Logit parity between engines: offline comparison, its command line, and shadow mode."""
