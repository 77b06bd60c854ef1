#!/usr/bin/env bash
# Every GPU check of the project in one planned command, for a session lent a GPU machine (the
# device tool): checks first (benchmarks/feature_check.py: every feature on the GPU against the
# CPU), timings after, each stage under its own limit, at most about 9.5 minutes in all. The plan
# and its limits are one table, benchmarks/session_plan.py (GPU_PLAN); benchmarks/session_runner.py
# runs it. Run from the repository root:
#
#     run(command="bash benchmarks/gpu_session.sh", timeout_s=600)
#
# What comes back in $OUT, two files: summary.json (written before the first stage and rewritten,
# atomically, after each: the plan, the machine, every stage's status, exit code, seconds, key
# numbers and whole JSON record) and session.log (every stage's output). Copy the numbers into
# docs/benchmarks.md with the command, the machine and the date.
#
# The machine has no network: orca_jax runs from this checkout (PYTHONPATH) on the machine's own
# jax/flax/transformers; nothing here needs gguf or the server's packages (fastapi, uvicorn).
# llguidance is missing there too, so the structured-outputs check reports "skipped: llguidance
# missing" unless its wheel travels with the tree. To carry it, once, here, in the repository root:
#
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         -d .whl llguidance
#     unzip -p .whl/llguidance-*.whl '*/METADATA' | grep ^Requires-Dist    # carry any it names too
#
# and call run(..., carry=[".whl"]): the script installs every wheel in .whl/ into /tmp/site first.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/orca_jax_gpu}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# "$@": extra runner flags (--plan-file PLAN.json runs another plan: the tests' fake one).
if [[ " $* " == *" --plan-file "* ]]; then plan=(); else plan=(--plan gpu); fi
exec "${PYTHON:-python3}" benchmarks/session_runner.py "${plan[@]}" --out "$OUT" "$@"
