"""Benchmark: does labkit's ``Scheduler`` decide each step as vLLM v1's own ``Scheduler`` does?

The same workloads are served by labkit's ``Scheduler`` and by vLLM 0.33.0's real v1
``Scheduler`` (``vllm/v1/core/sched/scheduler.py``, with its real ``KVCacheManager``,
coordinator and ``BlockPool``), step by step, on the CPU. vLLM's scheduler is built as its
own tests build it (``tests/v1/core/utils.py``, ``create_scheduler``): one full-attention
layer group, ``num_gpu_blocks`` blocks (one more than labkit's pool: vLLM holds block 0 back
as its null block), chunked prefill on, async scheduling off (the synchronous
``Scheduler``), ``max_model_len`` large enough for every request or, in four settings, small enough to stop
the long ones (vLLM counts it in tokens: ``check_stop``); each step a fake model
runner output is fed to ``update_from_output`` with one sampled token per request whose
chunk reached its last known token. Output tokens are fixed by (request, position), so both
sides see the same tokens whatever the schedule; some requests stop on a stop token.

Workloads mix shared system prompts, exact repeats, long prompts that must be chunked, stop
tokens, prefix caching on and off, ``max_num_seqs`` from 4 to 256, token budgets from 64 to
2,048 and pools small enough to preempt. Per setting the table reports the share of steps in
which both schedulers gave the same requests the same number of tokens, the share of
admissions (new or after a preemption) with the same prefix hit, the preemptions as
(step, request) pairs found on both sides over those found on either, the share of
requests finishing in the same step, and the share of runs whose prefix-cache counters are
equal at the end: requests, queries and hits of first admissions and of admissions after a
preemption (vLLM's ``PrefixCacheStats``, recorded at admission by
``KVCacheManager.record_prefix_cache_stats``; labkit's ``Scheduler`` records the same).

vLLM is not a dependency: its sources (the vLLM 0.33.0 wheel, unzipped) are imported from
``--vllm-src`` with every module the scheduler's decisions do not need replaced by an inert
stand-in (``vllm_replay.py``'s approach), plus small real stand-ins for what it does read
(its config as plain namespaces, a read-only list view, a structured-output manager that
accepts every token). Usage: ``python benchmarks/vllm_scheduler.py [--vllm-src /tmp/vllm_src]``;
``--chunk-only`` turns labkit's admission gate off (labkit's rule before issue 19). Run it on
an older labkit (``PYTHONPATH`` at another tree, with ``--old``) to compare.

Measured (2026-11-30, ``benchmarks/results/vllm_scheduler_2026-11-30.md``): 37,657 steps,
4,226 admissions, 386 preemptions, 100.0% the same on all four measures; labkit before issue 19
(commit d847dcb): 62.7% of steps, 71.0% of hits, 11.2% of preemptions and 58.5% of finishing
steps the same (1,994 preemptions against vLLM's 386). With the four settings where max_model_len binds
(2026-12-02, ``benchmarks/results/vllm_scheduler_2026-12-02.md``): 45,887 steps, 6,223 admissions, 463
preemptions, 100.0% the same on every column.
"""

from __future__ import annotations

import argparse
import random
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))

import vllm_replay  # noqa: E402  (the stand-ins for the parts of vLLM that are not needed)

SCHEDULER_MODULES = {"vllm.v1.core.sched", "vllm.v1.core.sched.scheduler", "vllm.v1.core.sched.request_queue",
                     "vllm.v1.core.sched.output", "vllm.v1.core.sched.utils", "vllm.v1.core.sched.interface",
                     "vllm.v1.request", "vllm.v1.outputs", "vllm.v1.metrics", "vllm.v1.metrics.stats",
                     "vllm.v1.metrics.cache_hit_source"}
BLOCK_SIZE = 16
VOCAB = 1000


class ConstantList(list):
    """vLLM's read-only list view (``vllm/v1/utils.py``), enough of it: a view of the list it wraps."""

    def __init__(self, x: list):
        self._x = x

    def __len__(self):
        return len(self._x)

    def __getitem__(self, i):
        return self._x[i]

    def __iter__(self):
        return iter(self._x)

    def __contains__(self, v):
        return v in self._x

    def __bool__(self):
        return bool(self._x)

    def copy(self):
        return list(self._x)


def import_vllm_scheduler(vllm_src: str) -> types.SimpleNamespace:
    """vLLM's v1 ``Scheduler``, ``Request`` and ``ModelRunnerOutput`` from the unzipped wheel."""
    vllm_replay.REAL_VLLM_MODULES.update(SCHEDULER_MODULES)
    sys.meta_path.insert(0, vllm_replay._StandIns())
    sys.path.insert(0, vllm_src)
    # Stand-ins that must behave: what vllm.v1.request reads when a request is made.
    utils = __import__("vllm.v1.utils", fromlist=["x"])
    utils.ConstantList = ConstantList
    so = __import__("vllm.v1.structured_output.request", fromlist=["x"])
    so.StructuredOutputRequest = types.SimpleNamespace(from_sampling_params=lambda params: None)
    from vllm.v1.core.kv_cache_utils import BlockHash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    return types.SimpleNamespace(Scheduler=Scheduler, Request=Request, RequestStatus=RequestStatus,
                                 ModelRunnerOutput=ModelRunnerOutput, BlockHash=BlockHash,
                                 FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig,
                                 KVCacheGroupSpec=KVCacheGroupSpec)


def vllm_config(num_blocks: int, budget: int, max_num_seqs: int, caching: bool, max_model_len: int):
    """The parts of ``VllmConfig`` the scheduler reads, as ``create_scheduler`` sets them."""
    ns = types.SimpleNamespace
    scheduler = ns(max_num_seqs=max_num_seqs, max_num_active_seqs=None, max_num_scheduled_tokens=None,
                   max_num_batched_tokens=budget, long_prefill_token_threshold=0,
                   long_prefill_token_threshold_adaptive=False, policy="fcfs", enable_chunked_prefill=True,
                   scheduler_reserve_full_isl=True, watermark=0.0, prefill_schedule_interval=1,
                   async_scheduling=False, disable_chunked_mm_input=False)
    cache = ns(num_gpu_blocks=num_blocks, enable_prefix_caching=caching, block_size=BLOCK_SIZE,
               enable_mamba_shared_prefix_checkpoint=False, mamba_cache_mode="none")
    model = ns(uses_mrope=False, max_model_len=max_model_len, is_encoder_decoder=False, runner_type="generate",
               is_diffusion=False, supports_multimodal_inputs=False, return_sampling_mask=False)
    parallel = ns(data_parallel_index=0, decode_context_parallel_size=1, prefill_context_parallel_size=1,
                  pipeline_parallel_size=1, data_parallel_size=1)
    observability = ns(per_request_spec_decode_metrics="none", kv_cache_metrics=False, kv_cache_metrics_sample=0,
                       enable_mfu_metrics=False, enable_logging_iteration_details=False)
    return ns(scheduler_config=scheduler, cache_config=cache, lora_config=None, model_config=model,
              kv_events_config=None, parallel_config=parallel, observability_config=observability,
              is_mm_encoder_only=False, kv_transfer_config=None, ec_transfer_config=None,
              max_concurrent_batches=1, ec_manager_config=ns(get_encoder_cache_manager_obj=lambda: None),
              speculative_config=None, num_speculative_tokens=0, num_lookahead_tokens=0,
              num_prefill_lookahead_tokens=0, num_hash_lookahead_tokens=0, use_v2_model_runner=False,
              max_in_flight_tokens=budget, aux_output_config=ns(enabled=False))


def output_token(index: int, position: int) -> int:
    """The token request ``index`` samples at output ``position``: fixed, whatever the schedule."""
    return (index * 7919 + position * 104729 + (index * position) % 13) % VOCAB


def make_workload(rng: random.Random, num_requests: int, pool_tokens: int,
                  max_model_len: int | None = None) -> list[tuple[int, list[int], int, list[int]]]:
    """(arrival step, prompt, max_new_tokens, stop ids) per request. With ``max_model_len``, prompts are cut to
    ``max_model_len - 1`` tokens (vLLM refuses longer ones before they reach the scheduler) and
    ``max_new_tokens`` is left as drawn, so that the cap binds for the long prompts."""
    systems = [[rng.randrange(VOCAB) for _ in range(rng.choice([32, 48, 64, 100]))] for _ in range(3)]
    docs = [[rng.randrange(VOCAB) for _ in range(rng.randint(300, 1500))] for _ in range(2)]
    out, step, prompts = [], 0, []
    for _ in range(num_requests):
        step += rng.choice([0, 0, 0, 1, 1, 2, 5])
        kind = rng.random()
        if kind < 0.35:    # chat with a shared system prompt
            prompt = rng.choice(systems) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 120))]
        elif kind < 0.5 and prompts:   # an exact repeat
            prompt = list(rng.choice(prompts))
        elif kind < 0.7:   # a long document and a question: chunked when the budget is small
            prompt = rng.choice(docs) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        else:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 400))]
        new = rng.randint(1, 96)
        prompt = prompt[:max(1, pool_tokens - new)]
        if max_model_len is not None:
            prompt = prompt[:max_model_len - 1]
        stop = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))] if rng.random() < 0.4 else []
        prompts.append(prompt)
        out.append((step, prompt, new, stop))
    return out


class Trace:
    """What one scheduler decided: per step the map request -> tokens; admissions with their hit;
    preemptions as (step, request); the step each request finished in."""

    def __init__(self):
        self.steps: list[dict[int, int]] = []
        self.hits: dict[tuple[int, int], int] = {}   # (request, admission number) -> cached tokens
        self.preemptions: set[tuple[int, int]] = set()
        self.finished: dict[int, int] = {}
        self.cache_stats: tuple[int, ...] = ()  # requests, queries, hits, and the same for preempted admissions


def run_labkit(work, num_blocks, budget, max_num_seqs, caching, gate, max_steps, max_model_len=None) -> Trace:
    from labkit.serving.request import Request
    from labkit.serving.scheduler import Scheduler

    kw = {} if gate is None else {"full_sequence_must_fit": gate}
    if max_model_len is not None:
        kw["max_model_len"] = max_model_len
    sched = Scheduler(num_blocks, BLOCK_SIZE, budget, max_num_seqs=max_num_seqs, enable_prefix_caching=caching, **kw)
    requests = [Request(p, new, stop or None, request_id=i) for i, (_, p, new, stop) in enumerate(work)]
    trace, admissions = Trace(), [0] * len(work)
    for t in range(max_steps):
        for i, (at, *_) in enumerate(work):
            if at == t:
                sched.add_request(requests[i])
        if not sched.has_unfinished():
            if t > work[-1][0]:
                break
            trace.steps.append({})
            continue
        running = {id(r) for r in sched.running}
        step = sched.schedule()
        trace.steps.append({c.request.request_id: c.num_tokens for c in step.chunks})
        for r in step.preempted:
            trace.preemptions.add((t, r.request_id))
        for c in step.chunks:
            if id(c.request) not in running:
                rid = c.request.request_id
                trace.hits[rid, admissions[rid]] = c.start
                admissions[rid] += 1
        sampled = [output_token(c.request.request_id, len(c.request.output_token_ids)) for c in step.sampling_chunks]
        for r in sched.postprocess(step, sampled):
            trace.finished[r.request_id] = t
    trace.cache_stats = _counts(sched.prefix_cache.stats)
    return trace


def _counts(stats) -> tuple:
    """Both sides' ``PrefixCacheStats`` fields (labkit before issue 31 had other counters: ``None``)."""
    return tuple(getattr(stats, name, None) for name in ("requests", "queries", "hits", "preempted_requests",
                                                           "preempted_queries", "preempted_hits"))


def run_vllm(v, work, num_blocks, budget, max_num_seqs, caching, max_steps, max_model_len=None) -> Trace:
    from labkit.memory.prefix import hash_chain

    max_model_len = max_model_len or 1 << 16  # None: large enough never to bind
    spec = v.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=__import__("torch").float32)
    kv_config = v.KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[],  # + vLLM's null block
                                kv_cache_groups=[v.KVCacheGroupSpec(["layer"], spec)])
    config = vllm_config(num_blocks + 1, budget, max_num_seqs, caching, max_model_len)
    structured = types.SimpleNamespace(accept_tokens=lambda request, tokens: True,
                                       should_advance=lambda request: False)
    sched = v.Scheduler(vllm_config=config, kv_cache_config=kv_config, structured_output_manager=structured,
                        block_size=BLOCK_SIZE, log_stats=True)
    # Its prefix-cache counters (KVCacheManager.record_prefix_cache_stats, at admission) add up over the
    # whole run: the per-step SchedulerStats that would reset them are not made here.
    sched.make_stats = lambda *args, **kwargs: None

    def hasher(request):  # labkit's hash chain, as vllm_replay.py: the new full blocks' names
        known = len(request.block_hashes)
        if len(request.all_token_ids) // BLOCK_SIZE <= known:
            return []
        return [v.BlockHash(h.encode()) for h in hash_chain(list(request.all_token_ids), BLOCK_SIZE)[known:]]

    def params(new, stop):
        return types.SimpleNamespace(max_tokens=new, stop_token_ids=stop, eos_token_id=None, min_tokens=0,
                                     repetition_detection=None, extra_args=None, ignore_eos=False,
                                     num_logprobs=None, logprobs=None, prompt_logprobs=None,
                                     skip_reading_prefix_cache=None, structured_outputs=None)

    requests = [v.Request(str(i), list(p), params(new, stop), None, arrival_time=float(i), block_hasher=hasher)
                for i, (_, p, new, stop) in enumerate(work)]
    trace, admissions = Trace(), [0] * len(work)
    RUNNING = v.RequestStatus.RUNNING
    for t in range(max_steps):
        for i, (at, *_) in enumerate(work):
            if at == t:
                sched.add_request(requests[i])
        live = [r for r in requests if r.request_id in sched.requests]
        if not live:
            if t > work[-1][0]:
                break
            trace.steps.append({})
            continue
        before = {r.request_id: (r.status, r.num_preemptions) for r in live}
        out = sched.schedule()
        scheduled = {int(rid): n for rid, n in out.num_scheduled_tokens.items()}
        trace.steps.append(scheduled)
        for r in live:
            status, preemptions = before[r.request_id]
            rid = int(r.request_id)
            if r.num_preemptions > preemptions:
                trace.preemptions.add((t, rid))
            if status != RUNNING and r.status == RUNNING:
                trace.hits[rid, admissions[rid]] = r.num_computed_tokens - scheduled[rid]
                admissions[rid] += 1
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            r = sched.requests[rid]
            sampled.append([output_token(int(rid), len(r.output_token_ids))] if r.num_computed_tokens == r.num_tokens
                           else [])
        sched.update_from_output(out, v.ModelRunnerOutput(req_ids=req_ids,
                                                          req_id_to_index={r: k for k, r in enumerate(req_ids)},
                                                          sampled_token_ids=sampled))
        for r in live:
            if r.request_id not in sched.requests and int(r.request_id) not in trace.finished:
                trace.finished[int(r.request_id)] = t
    trace.cache_stats = _counts(sched.kv_cache_manager.prefix_cache_stats)
    return trace


def compare(a: Trace, b: Trace) -> tuple[int, int, int, int, int, int, int, int, int]:
    """(steps, same steps, admissions, same hits, preemption pairs on either side, on both, requests, same finish,
    1 if the prefix-cache counters are equal)."""
    n = max(len(a.steps), len(b.steps))
    steps = [(a.steps[i] if i < len(a.steps) else None, b.steps[i] if i < len(b.steps) else None) for i in range(n)]
    same_steps = sum(1 for x, y in steps if x == y)
    keys = set(a.hits) | set(b.hits)
    same_hits = sum(1 for k in keys if a.hits.get(k, -1) == b.hits.get(k, -2))
    either, both = len(a.preemptions | b.preemptions), len(a.preemptions & b.preemptions)
    ids = set(a.finished) | set(b.finished)
    same_finish = sum(1 for i in ids if a.finished.get(i, -1) == b.finished.get(i, -2))
    return n, same_steps, len(keys), same_hits, either, both, len(ids), same_finish, int(a.cache_stats == b.cache_stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-src", default="/tmp/vllm_src")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--chunk-only", action="store_true", help="labkit without the full-sequence gate")
    parser.add_argument("--old", action="store_true", help="an older labkit without full_sequence_must_fit")
    args = parser.parse_args()
    v = import_vllm_scheduler(args.vllm_src)
    gate = None if args.old else not args.chunk_only
    # (max_num_seqs, budget, pool blocks, max_model_len): from loose to tight; every pool holds any one request.
    # max_model_len None never binds; the last four settings cap requests at max_model_len tokens (vLLM's
    # check_stop), so that long prompts stop before their max_new_tokens.
    settings = [(256, 2048, 2000, None), (256, 2048, 160, None), (64, 512, 160, None), (16, 256, 120, None),
                (4, 64, 120, None), (256, 64, 200, None), (16, 2048, 100, None), (64, 128, 140, None),
                (256, 2048, 160, 512), (64, 512, 160, 256), (16, 128, 120, 1024), (4, 64, 120, 100)]
    header = (f"{'max_num_seqs':>12} {'budget':>6} {'blocks':>6} {'max_model_len':>13} {'caching':>7} {'steps':>6} "
              f"{'same steps':>10} "
              f"{'admissions':>10} {'same hit':>8} {'preemptions l/v':>15} {'same preempt.':>13} {'same finish':>11} "
              f"{'same counters':>13}")
    lines = [header]
    total = [0] * 9
    pre_l = pre_v = 0
    capped = total_capped = 0
    for seqs, budget, blocks, max_model_len in settings:
        for caching in (True, False):
            row = [0] * 9
            pl = pv = 0
            for seed in range(args.seeds):
                rng = random.Random(seed * 1000 + seqs + budget + blocks)
                work = make_workload(rng, args.requests, blocks * BLOCK_SIZE, max_model_len)
                a = run_labkit(work, blocks, budget, seqs, caching, gate, 20_000, max_model_len)
                b = run_vllm(v, work, blocks, budget, seqs, caching, 20_000, max_model_len)
                if max_model_len is not None:  # requests the cap stopped before their max_new_tokens
                    capped += sum(1 for _, p, new, _ in work if len(p) + new > max_model_len)
                total_capped += len(work) if max_model_len is not None else 0
                row = [x + y for x, y in zip(row, compare(a, b))]
                pl, pv = pl + len(a.preemptions), pv + len(b.preemptions)
            total = [x + y for x, y in zip(total, row)]
            pre_l, pre_v = pre_l + pl, pre_v + pv
            lines.append(_row(f"{seqs:>12} {budget:>6} {blocks:>6} {max_model_len or '-':>13} "
                              f"{'on' if caching else 'off':>7}", row, pl, pv, args.seeds))
    lines.append(_row(f"{'all':>12} {'':>6} {'':>6} {'':>13} {'':>7}", total, pre_l, pre_v,
                      args.seeds * 2 * len(settings)))
    print("\n".join(lines))
    print(f"max_model_len bound (prompt + max_new_tokens > max_model_len) for {capped:,} of the "
          f"{total_capped:,} requests served under a max_model_len")


def _row(label: str, r: list[int], pl: int, pv: int, runs: int) -> str:
    n, ss, adm, sh, either, both, ids, sf, counters = r
    return (f"{label} {n:>6,} {ss / n:>10.1%} {adm:>10,} {sh / max(adm, 1):>8.1%} {f'{pl:,}/{pv:,}':>15} "
            f"{(both / either if either else 1.0):>13.1%} {sf / max(ids, 1):>11.1%} {counters / runs:>13.1%}")


if __name__ == "__main__":
    main()
