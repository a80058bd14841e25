"""The llama.cpp engine: the adapter (`engine`), its continuous-batching scheduler (`batch`),
embeddings (`embed`), and what a build and its devices are (`ggml_devices`, `ggml_backends`)."""
