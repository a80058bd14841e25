"""Exports of a Hugging Face checkpoint into the formats of the runtimes that do not read GGUF (the
`Converter`s of their descriptors, engines/runtimes.py). Each runs in a child process of
`gateway convert`, so torch and the converters never load into the gateway."""
