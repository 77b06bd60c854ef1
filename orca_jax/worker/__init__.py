"""What runs a step on devices: the model runner and its exported step programs, pipeline
stages, the persistent batch, sampling and the speculative acceptance rule inside the jitted
step, multi-host start-up, the compilation cache and guard. Above core: it turns the
scheduler's ScheduledBatch into device arrays."""
