"""What the connector's tests and benchmark run, not the connector: `instance` (one vLLM
engine in this process on token prompts), `tiny` (a tiny Llama written locally, so nothing
is downloaded) and `messager` (the messager with a planted fault)."""
