"""Drive the real vLLM for the book (appendix A4, benchmarks/vllm_cpu.py, tests/test_real_vllm.py).

This script runs with the Python of vLLM's own environment (``.venv-vllm``, built by ``make vllm``),
never with the book's: vLLM is no dependency of labkit. It imports the standard library and vLLM
only (and one file of labkit's that imports nothing, by its path: ``labkit/serving/sim/work.py``),
and speaks JSON. ``labkit.vllm_bridge.real`` starts it, from the book's side; nothing imports it.

* ``offline JOB.json OUT.json``: vLLM's offline ``LLM`` class, once per run in the job (one after
  the other, in this process). A run is ``{"engine": LLM's arguments, "prompts": token ids,
  "max_tokens": one per prompt, "env": variables for this engine}``; its engine serves its prompts
  (greedy, all at once; token ids, so no tokenizer round trip can change them) and reports every
  step it ran (below), the tokens, the prefix-cache hit of each
  request at its first admission (``RequestOutput.num_cached_tokens``), its counters (read from
  ``LLM.get_metrics()``: prefix-cache queries and hits, preemptions, blocks) and the lines its
  start-up logged about the KV cache, verbatim. vLLM logs from child processes (the engine core,
  the worker): their output is caught at the file descriptors, which children inherit.
* ``cli ARGS...``: vLLM's own command line, ``vllm ARGS...`` (``serve``, ``bench serve``). The
  ``vllm`` console script of the ``vllm-cpu`` package stops at once (``vllm/entrypoints/cli/main.py``
  asks for the version of a distribution named ``vllm``; this one is named ``vllm-cpu``); here that
  one lookup is answered, as vllm-cpu's own platform check answers it (below).

With ``LABKIT_VLLM_STEP_LOG=FILE`` in the environment, every engine step that runs the model is
appended to FILE as one JSON line: its wall time, the three sums chapter 06's cost model reads
(new tokens, tokens already cached, query-key pairs: ``labkit.serving.sim.work.work_sums``, the rule
that counts labkit's steps too), the tokens each
request was given and the requests preempted. vLLM starts its engine core by ``spawn``, which
imports this file again in the child, so the recorder is installed there too, around
``EngineCore.step`` and ``Scheduler.schedule`` (with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the
engine core runs in this process, and the recorder with it).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

STEP_LOG = "LABKIT_VLLM_STEP_LOG"
# The start-up lines about the KV cache (vllm/v1/worker/cpu_worker.py, vllm/v1/core/kv_cache_utils.py).
LOG_LINES = re.compile(r"\] ((?:Explicitly set|Auto set) .*GiB for KV cache.*|CPU KV cache size: .*"
                       r"|Overriding num_gpu_blocks=.*)$")


# --------------------------------------------------------------------------- the step recorder


def _load_work_sums():
    """``work_sums`` from labkit's ``serving/sim/work.py``, loaded by its path: that module imports nothing,
    so labkit (and its torch and Triton settings) stays out of vLLM's process."""
    path = Path(__file__).resolve().parents[1] / "serving" / "sim" / "work.py"
    spec = importlib.util.spec_from_file_location("labkit_work_sums", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.work_sums


work_sums = _load_work_sums()


def step_sums(scheduler_output) -> tuple[int, int, float]:
    """Σ new tokens, Σ tokens already computed, Σ query-key pairs of one vLLM ``SchedulerOutput``."""
    computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    return work_sums((computed[req_id], k) for req_id, k in scheduler_output.num_scheduled_tokens.items())


_recorder_installed = False


def install_step_recorder() -> None:
    """Time every ``EngineCore.step`` and append what it scheduled to the file named by ``LABKIT_VLLM_STEP_LOG``
    (read at every step, so that each engine of a job can have its own; nothing while it is unset)."""
    global _recorder_installed
    if _recorder_installed:
        return
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    schedule, step = Scheduler.schedule, EngineCore.step

    def recording_schedule(self, *args, **kwargs):
        self._labkit_output = schedule(self, *args, **kwargs)
        return self._labkit_output

    def timed_step(self):
        self.scheduler._labkit_output = None
        start = time.perf_counter()
        result = step(self)
        seconds = time.perf_counter() - start
        output, path = self.scheduler._labkit_output, os.environ.get(STEP_LOG)
        if path and output is not None and output.total_num_scheduled_tokens:
            new, ctx, pairs = step_sums(output)
            with open(path, "a") as f:
                f.write(json.dumps({"time": time.time(), "seconds": seconds, "new_tokens": new,
                                    "context_tokens": ctx, "pairs": pairs,
                                    "num_requests": len(output.num_scheduled_tokens),
                                    "scheduled": output.num_scheduled_tokens,
                                    "preempted": sorted(output.preempted_req_ids or ())}) + "\n")
        return result

    Scheduler.schedule, EngineCore.step = recording_schedule, timed_step
    _recorder_installed = True


if os.environ.get(STEP_LOG):  # in the parent and in every spawned child (this file is their __mp_main__)
    install_step_recorder()


# --------------------------------------------------------------------------- offline


@contextlib.contextmanager
def captured_output(path: str):
    """Send file descriptors 1 and 2 (ours and those of every child started meanwhile) to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def counters(llm) -> dict[str, float]:
    """vLLM's own counters, as ``LLM.get_metrics()`` reads them from its Prometheus registry."""
    out = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:")
        if name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions"):
            out[name] = metric.value
        elif name == "cache_config_info":
            out["num_gpu_blocks"] = int(metric.labels["num_gpu_blocks"])
    return out


@contextlib.contextmanager
def environment(variables: dict[str, str]):
    """Set ``variables`` for the duration (vLLM reads its variables when it uses them, engine by engine).

    Every name and value must be a string, checked before any is set: ``os.environ`` would refuse a
    number halfway through, the variables before it set and never restored.
    """
    if not isinstance(variables, dict) or not all(isinstance(k, str) and k and "=" not in k and isinstance(v, str)
                                                  for k, v in variables.items()):
        raise ValueError(f"variables must be a dict of variable names to strings, got {variables!r}")
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def serve_offline(engine: dict, prompts: list[list[int]], max_tokens: list[int], log_path: str,
                  env: dict[str, str], ignore_eos: bool = False) -> dict:
    """One ``LLM`` with ``engine`` as its arguments serves every prompt at once; what it reports.

    ``env``: environment variables for this engine only. ``ignore_eos``: every request runs to its
    ``max_tokens``. The engine's steps go to a file of their own (``log_path`` + ".steps").
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    steps_path = log_path + ".steps"
    with environment({**env, STEP_LOG: steps_path}), captured_output(log_path):
        install_step_recorder()  # for an engine core in this process; a spawned one installs its own
        start = time.perf_counter()
        llm = LLM(**engine)
        started = time.perf_counter()
        before = counters(llm)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos) for n in max_tokens]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False) \
            if prompts else []
        generated = time.perf_counter()
        after = counters(llm)
        llm.llm_engine.engine_core.shutdown()  # the engine core's process, or the engine in this one
        del llm
        gc.collect()
    with open(log_path) as f:
        log = [m.group(1) for line in f if (m := LOG_LINES.search(line.rstrip()))]
    steps = []
    if os.path.exists(steps_path):
        with open(steps_path) as f:
            steps = [json.loads(line) for line in f]
    return {
        "engine": engine,
        "log": log,
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
        "num_cached_tokens": [o.num_cached_tokens for o in outputs],
        "counters": {k: after[k] - before.get(k, 0) if k != "num_gpu_blocks" else after[k] for k in after},
        "steps": steps,
        "start_up_s": started - start,
        "generate_s": generated - started,
    }


def offline(job_path: str, out_path: str) -> None:
    """Every run of the job, one engine after another; the reports, and vLLM's version, to ``out_path``."""
    with open(job_path) as f:
        job = json.load(f)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for i, run in enumerate(job["runs"]):
            results.append(serve_offline(run["engine"], run["prompts"], run["max_tokens"],
                                         os.path.join(scratch, f"{i}.log"), run.get("env", {}),
                                         run.get("ignore_eos", False)))
    import vllm

    with open(out_path, "w") as f:
        json.dump({"vllm_version": vllm.__version__, "runs": results}, f)


# --------------------------------------------------------------------------- vLLM's command line


def vllm_cpu_version(version):
    """``version`` (``importlib.metadata.version``), answering for a distribution named ``vllm`` too.

    Where no distribution named ``vllm`` is installed, its version is vllm-cpu's plus ``+cpu``: what
    vllm-cpu's ``vllm/platforms/__init__.py: vllm_version_matches_substr`` reads, so that vLLM still
    finds its CPU platform by the "cpu" in its version. (Answering vllm-cpu's bare "0.32.0" hid the
    CPU: ``serve`` then stopped with "Failed to infer device type" unless the step recorder had
    imported vLLM's engine, and with it the platform, before the lookup was replaced.)
    """
    import importlib.metadata

    def version_of(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    return version_of


def cli(argv: list[str]) -> None:
    """``vllm ARGS...``: vLLM's command line, with the version lookup of the ``vllm-cpu`` package fixed
    (:func:`vllm_cpu_version`)."""
    import importlib.metadata

    importlib.metadata.version = vllm_cpu_version(importlib.metadata.version)
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or ["--help"]
    if command == "offline" and len(rest) == 2:
        offline(*rest)
    elif command == "cli":
        cli(rest)
    else:
        sys.exit(__doc__)
