"""LLMEngine: requests in, the step loop (schedule, run, postprocess; overlapped in the async
engine), detokenizing, outputs out. The layer between the entrypoints above and the scheduler
(core) and worker below, which it drives once per iteration.

`orca_jax.engine.LLMEngine` is resolved on first use, so importing a module of this folder
(outputs, request) does not load the engine itself."""


def __getattr__(name: str):
    if name == "LLMEngine":
        from orca_jax.engine.engine import LLMEngine
        return LLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
