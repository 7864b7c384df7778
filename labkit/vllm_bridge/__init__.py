"""vLLM beside the book: what labkit predicts vLLM will do, and the real vLLM run to check (A2, A4, A5).

* ``predict``: vLLM's start-up KV-cache arithmetic, without vLLM: budget, blocks, concurrency, refusals;
* ``real``: the real vLLM (``make vllm``'s environment) run from here: offline, as a server, benchmarked;
* ``driver``: the script that runs *inside* vLLM's environment (never imported by labkit);
* ``record``: the committed record of the real runs, which the appendix shows where vLLM is absent;
* ``compare``: one workload served by both engines, reported alike.
"""
