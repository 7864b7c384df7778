"""Serving: who runs each step, with how many tokens, and what that does to latency (chapters 05 to 07).

* ``request``: ``Request``, a prompt, its limits and where it stands;
* ``step``: what one step hands the model (``Step``, ``ScheduledChunk``, ``Decision``, ``StepStats``);
* ``scheduler``: the core, ``plan_iteration`` (the article's budget pass) and ``Scheduler`` (vLLM's loop);
* ``engine``: ``Engine``, the scheduler, a ``KVPool`` and a model, step by step;
* ``pieces``: the engine's seams for the build-it pieces (``Pieces``, ``PiecesScheduler``), the capstone;
* ``dry_run``: the scheduler run without a model, for reading its steps;
* ``variants``: schedulers beside the core, each through one hook (forking, priority, reservation);
* ``sim``: workloads, the cost model, the simulator, its calibration on a measured engine, and
  Mooncake's conversation trace;
* ``cluster``: many replicas behind a router (chapter 07): the routers (round-robin, least loaded,
  session, cache-aware) and N simulated servers on one clock, each with its own prefix cache.
"""
