"""`orca-jax bench`: reproducing Orca's experiment (OSDI 2022, section 6) with orca_jax, from an
installed wheel. (The accelerator-session scripts live in benchmarks/ of the repository; its
README says why the two trees are apart.)

    trace.py        the synthetic workload: Poisson arrivals, uniform lengths, a length scale
    latency.py      normalized latency, percentiles, per-run summaries, curve interpolation
    driver.py       the engine in-process under an open-loop arrival process
    orca.py         `bench orca`: both scheduling policies over a sweep of arrival rates
    offline.py      `bench offline`: everything at t=0, against transformers' peers
    peers.py        transformers' static-batch `generate` and continuous batching (needs torch)
    vllm_peer.py    vLLM's CPU build as a peer, in its own Python environment, through a subprocess
    vllm_child.py   the script that subprocess runs (imports only vLLM and the standard library)
    roofline.py     measured matmul rate and the workload's FLOPs: how far from the machine's limit
    serve_client.py `bench serve`: the same trace over HTTP against any OpenAI-compatible server
    cost_model.py   step time of a large model on a multi-GPU machine, from FLOPs and bytes
    simulate.py     `bench simulate`: the real scheduler and page allocator on a virtual clock
    startup.py      `bench startup`: process start to first token of `orca-jax generate`, cold and warm caches
    host.py         `bench host`: host time per step, part by part, and device idle time, sync vs async
    random_model.py random Llama checkpoints (numpy + safetensors) for bench host and the GPU scripts
    cost_models/    the cost models' parameters, one TOML per machine and model (shipped)
    plots.py        the figure: median normalized latency against throughput, one curve per policy
    environment.py  machine, versions, memory, the command: what every JSON record states
    cli.py          the `orca-jax bench` subcommands

Nothing here is imported by the engine; heavy imports (jax, torch, matplotlib, httpx) happen
inside the functions that need them, so `orca-jax --help` stays fast.
"""
