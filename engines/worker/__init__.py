"""Engines in other processes: the worker process (`server`, run as `python -m engines.worker`),
the gateway's side of it behind the Engine interface (`client`), and the frames between them
(`wire`)."""
