"""Benchmark: does labkit's scheduler find and place what vLLM v1's ``KVCacheManager`` would?

labkit's ``Scheduler`` serves request streams (arrivals per step, synthetic output
tokens). Each of its steps is replayed, call for call, on vLLM v1's own
``KVCacheManager`` (``vllm/v1/core/kv_cache_manager.py``, with its real coordinator,
single-type manager and ``BlockPool``), the way vLLM's ``Scheduler.schedule`` calls it for
a full-attention model:

* admission: ``get_computed_blocks(request)`` (the hit, up to ``num_tokens - 1`` tokens),
  then ``allocate_slots(request, num_new_tokens, num_new_computed_tokens,
  new_computed_blocks)``, which also names the full blocks scheduled (``cache_blocks``);
* a running request's chunk: ``allocate_slots(request, num_new_tokens)``;
* preemption: ``free(request)`` when a running request's chunk does not fit, newest first, as
  vLLM's ``Scheduler.schedule`` does it inside its pass; finishing: ``free(request)``.

The request vLLM sees is a plain object carrying what the manager reads (ids, token counts,
``block_hashes``); both sides hash blocks with labkit's chain, so what is compared is the
policy: which blocks carry names, which free block is handed out next, which hit is found.
For every admission the table reports whether vLLM found the same number of cached tokens,
and whether both chose the same physical blocks (vLLM's ids are one higher: its block 0 is
a reserved null block); a step vLLM could not allocate counts as a disagreement. Measured
(2026-11-30, vLLM 0.33.0, 300 requests x 5 seeds x 2 pool sizes per workload): 10,933
admissions, 100.0% the same hit and 100.0% the same blocks (after issue 19's admission gate and
preemption inside the pass: 10,747 admissions, again 100.0% and 100.0%); the labkit before issue 11 (names
given after the step, every freed block to the back, duplicates unnamed; commit ed834b2) agreed
on 96.0% of 10,971 hits and 2.2% of block choices.

vLLM is not a dependency: its sources (the vLLM 0.33.0 wheel, unzipped) are imported
from ``--vllm-src`` with every module the KV cache manager does not need replaced by an
inert stand-in. Usage: ``python benchmarks/vllm_replay.py [--vllm-src /tmp/vllm_src]``.
Run it on an older labkit (``PYTHONPATH`` at another tree) to compare.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import random
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

REAL_VLLM_MODULES = {"vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.block_pool", "vllm.v1.core.kv_cache_utils",
                     "vllm.v1.core.kv_cache_manager", "vllm.v1.core.kv_cache_coordinator",
                     "vllm.v1.core.single_type_kv_cache_manager", "vllm.v1.core.kv_cache_metrics",
                     "vllm.v1.kv_cache_interface", "vllm.v1.kv_cache_layout", "vllm.v1.kv_cache_spec_registry",
                     "vllm.utils", "vllm.utils.math_utils"}


class _Inert(type):
    """Any attribute, call or subscript of a stand-in gives another stand-in."""

    def __getattr__(cls, name):
        return _Inert(name, (), {})

    def __call__(cls, *args, **kwargs):
        return _Inert("value", (), {})

    def __getitem__(cls, key):
        return cls

    def __iter__(cls):  # an empty collection (else iterating would call __getitem__ forever)
        return iter(())

    def __enter__(cls):  # a context manager that does nothing (a profiler's record_function)
        return cls

    def __exit__(cls, *exc):
        return False

    def __or__(cls, other):
        return cls

    __ror__ = __or__


class _InertModule(types.ModuleType):
    __path__: list[str] = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(name, (), {})


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "vllm" and name not in REAL_VLLM_MODULES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _InertModule(spec.name)

    def exec_module(self, module):
        pass


def import_vllm(vllm_src: str) -> types.SimpleNamespace:
    """vLLM's KV cache manager and what it takes, from the unzipped wheel at ``vllm_src``."""
    sys.meta_path.insert(0, _StandIns())
    sys.path.insert(0, vllm_src)
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import BlockHash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    return types.SimpleNamespace(KVCacheManager=KVCacheManager, BlockHash=BlockHash, FullAttentionSpec=FullAttentionSpec,
                                 KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec)


class VllmReplay:
    """vLLM's ``KVCacheManager`` for one full-attention layer group, and the requests it has seen."""

    def __init__(self, vllm: types.SimpleNamespace, num_blocks: int, block_size: int):
        import torch

        spec = vllm.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16)
        config = vllm.KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[],  # + vLLM's null block
                                    kv_cache_groups=[vllm.KVCacheGroupSpec(["layer.0"], spec)])
        self.manager = vllm.KVCacheManager(config, max_model_len=1 << 20, scheduler_block_size=block_size,
                                           hash_block_size=block_size, enable_caching=True)
        self.BlockHash, self.block_size = vllm.BlockHash, block_size
        self.requests: dict[object, types.SimpleNamespace] = {}  # admitted, by request id

    def _sync(self, r, request) -> None:
        """What vLLM's ``Request`` knows after its tokens were appended: counts and full-block hashes."""
        from labkit.memory.prefix import hash_chain

        tokens = r.all_token_ids
        request.num_tokens, request.all_token_ids = len(tokens), tokens
        if len(tokens) // self.block_size > len(request.block_hashes):
            request.block_hashes = [self.BlockHash(h.encode()) for h in hash_chain(tokens, self.block_size)]

    def admit(self, r, end: int) -> tuple[int, list[int]] | None:
        """A waiting request scheduled up to token ``end``: (cached tokens, block ids), or None if refused."""
        request = types.SimpleNamespace(
            request_id=r.request_id, num_prompt_tokens=len(r.prompt_token_ids), num_computed_tokens=0,
            num_in_flight_tokens=0, num_preemptions=r.num_preemptions, status=None, block_hashes=[],
            lora_request=None, lora_name=None, lora_path=None, cache_salt=None, mm_features=[], prompt_embeds=None,
            skip_reading_prefix_cache=False, shared_prefix_boundary=0, session_id=None)
        self._sync(r, request)
        blocks, num_hit, _ = self.manager.get_computed_blocks(request)
        if self.manager.allocate_slots(request, end - num_hit, num_hit, blocks) is None:
            return None
        request.num_computed_tokens = end
        self.requests[r.request_id] = request
        return num_hit, [b - 1 for b in self.manager.get_block_ids(r.request_id)[0]]

    def grow(self, r, num_new_tokens: int) -> bool:
        """A running request's chunk of ``num_new_tokens``; False if vLLM could not allocate it."""
        request = self.requests[r.request_id]
        self._sync(r, request)
        if self.manager.allocate_slots(request, num_new_tokens) is None:
            return False
        request.num_computed_tokens += num_new_tokens
        return True

    def free(self, request_id) -> None:
        self.manager.free(self.requests.pop(request_id))


def workload(kind: str, rng: random.Random, num_requests: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, max_new_tokens) per request."""
    out = []
    docs = [[rng.randrange(1000) for _ in range(rng.randint(64, 256))] for _ in range(4)]
    step = 0
    for i in range(num_requests):
        if kind == "bursty documents":
            step += rng.choice([0, 0, 0, 0, 1, 6])
            prompt = rng.choice(docs) + [rng.randrange(1000) for _ in range(rng.randint(1, 24))]
        elif kind == "duplicates":
            step += rng.choice([0, 1, 2])
            prompt = list(rng.choice(docs[:2]))[: rng.randint(17, 80)]
        else:  # "chat"
            step += rng.choice([0, 1, 1, 2])
            system = [7] * 32 if rng.random() < 0.5 else []
            prompt = system + [rng.randrange(1000) for _ in range(rng.randint(4, 200))]
        out.append((step, prompt, rng.randint(1, 48)))
    return out


def replay(kind: str, seed: int, num_requests: int, num_blocks: int, block_size: int, budget: int,
           vllm: types.SimpleNamespace) -> tuple[int, int, int, int]:
    from labkit.serving.request import Request
    from labkit.serving.scheduler import Scheduler

    rng = random.Random(seed)
    sched = Scheduler(num_blocks, block_size, budget)
    mirror = VllmReplay(vllm, num_blocks, block_size)
    arrivals: dict[int, list] = {}
    for i, (t, prompt, new) in enumerate(workload(kind, rng, num_requests)):
        arrivals.setdefault(t, []).append(Request(prompt, new, request_id=i))
    admissions = same_hit = same_blocks = preemptions = 0
    t = 0
    while sched.has_unfinished() or any(k >= t for k in arrivals):
        for r in arrivals.get(t, []):
            sched.add_request(r)
        t += 1
        step = sched.schedule()
        victims = list(step.preempted)  # newest first, each preempted in the turn of a request that did not fit
        preemptions += len(victims)
        for c in step.chunks:
            r = c.request
            if r.request_id not in mirror.requests:
                got = mirror.admit(r, c.start + c.num_tokens)
                admissions += 1
                same_hit += got is not None and got[0] == c.num_cached_tokens
                same_blocks += got is not None and got[1] == list(c.block_table)
                continue
            while not mirror.grow(r, c.num_tokens):  # as vLLM: preempt the newest, then try again
                if not victims:
                    raise RuntimeError(f"vLLM could not allocate a chunk labkit scheduled (request {r.request_id})")
                mirror.free(victims.pop(0).request_id)
        for r in victims:  # preempted in the turn of a request that was itself preempted at last
            mirror.free(r.request_id)
        sampled = [rng.randrange(1000) for _ in step.sampling_chunks]
        for r in sched.postprocess(step, sampled):
            mirror.free(r.request_id)
    return admissions, same_hit, same_blocks, preemptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-src", default="/tmp/vllm_src")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    vllm = import_vllm(args.vllm_src)
    import labkit  # noqa: F401  (after the stand-ins: labkit itself never imports vllm)

    rows = []
    for kind in ("bursty documents", "duplicates", "chat"):
        totals = [0, 0, 0, 0]
        for seed in range(args.seeds):
            for num_blocks in (48, 160):
                result = replay(kind, seed, args.requests, num_blocks, 16, 256, vllm)
                totals = [a + b for a, b in zip(totals, result)]
        rows.append((kind, *totals))
    print(f"{'workload':<18} {'admissions':>10} {'preemptions':>11} {'same hit':>9} {'same blocks':>12}")
    for kind, n, hit, blocks, pre in rows:
        print(f"{kind:<18} {n:>10,} {pre:>11,} {hit / n:>9.1%} {blocks / n:>12.1%}")
    n = sum(r[1] for r in rows)
    print(f"{'all':<18} {n:>10,} {sum(r[4] for r in rows):>11,} {sum(r[2] for r in rows) / n:>9.1%} "
          f"{sum(r[3] for r in rows) / n:>12.1%}")


if __name__ == "__main__":
    main()
