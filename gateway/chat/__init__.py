"""The chat layer above every runtime: the model's own template renders the conversation (with
its tools, past calls and reasoning switch), and the model family's output is read back here."""
