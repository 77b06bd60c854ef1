"""The host-side core of serving: the scheduler that picks each iteration's batch, the sequences
it schedules, the page allocator and prefix cache of the KV pool, and SamplingParams. No device
code: the worker above turns a ScheduledBatch into device arrays and imports core, never the
other way."""
