"""Serving: who runs each step, with how many tokens, and what that does to latency (chapters 05 to 08).

* ``request``: ``Request``, a prompt, its limits and where it stands;
* ``step``: what one step hands the model (``Step``, ``ScheduledChunk``, ``Decision``, ``StepStats``);
* ``scheduler``: the core, ``plan_iteration`` (the article's budget pass) and ``Scheduler`` (vLLM's loop);
* ``engine``: ``Engine``, the scheduler, a ``KVPool`` and a model, step by step;
* ``pieces``: the engine's seams for the build-it pieces (``Pieces``, ``PiecesScheduler``), the capstone;
* ``dry_run``: the scheduler run without a model, for reading its steps;
* ``tiered_engine``: ``TieredEngine``, the engine with a second tier behind its prefix cache, real K/V
  saved on eviction and loaded back on a tier hit (chapter 08);
* ``handoff``: prefill on one engine, decode on another, for real: ``hand_over`` copies a request's
  written blocks into a ``DecodeEngine``'s inbox (chapter 08);
* ``variants``: schedulers beside the core, each through one hook (forking, priority, reservation, a
  second tier);
* ``sim``: workloads, the cost model, the simulator, its calibration on a measured engine,
  Mooncake's conversation trace, and the tiers' presets and break-even;
* ``cluster``: many replicas behind a router (chapter 07): the routers (round-robin, least loaded,
  session, cache-aware) and N simulated servers on one clock, each with its own prefix cache; prefill
  and decode on two pools, the K/V over a link (chapter 08).
"""
