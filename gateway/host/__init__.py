"""What the host has and where a model runs: probes, the devices table, selection, functional checks."""
