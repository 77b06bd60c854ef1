"""The ways in: LLM (the offline API), the OpenAI-compatible HTTP server and its protocol,
metrics, chat templates, tool calling and the engine presets. The top of the serving stack,
above the engine it drives. Nothing is imported here: `orca-jax generate` must not load the
server (FastAPI) to reach LLM."""
