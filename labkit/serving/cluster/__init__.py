"""Many replicas behind a router (chapter 07): each replica's prefix cache is its own, so where a
request is sent decides whether its prefix is found; and prefill and decode on two pools (chapter 08).

* ``routers``: how a request picks a replica: round-robin, least loaded, session affinity, and the
  cache-aware rule of SGLang's router and ``vllm-router`` (``cache_aware_choice``);
* ``cluster``: ``simulate``, N of chapter 06's simulated servers on one clock behind a router, and
  ``ClusterResult``, what they measured together and one by one;
* ``disagg``: ``simulate_split``, prefill replicas and decode replicas, each prompt's K/V over a link
  to a decode replica's inbox, ``SplitResult``, and ``goodput`` (the share of requests within both a
  TTFT and a TPOT target).
"""
