"""The serving simulator, and the simulator checked against a real engine (chapters 06 to 08, appendix A6).

* ``workloads``: request lengths, shared prefixes, Poisson arrivals; A6's chat requests;
* ``costmodel``: a roofline cost model of one step, and device presets;
* ``work``: what the cost model reads from a step (its three sums), for labkit's steps and vLLM's;
* ``simulator``: ``Simulator``, chapter 05's scheduler plus a clock, and ``SimResult``;
* ``skipahead``: many pure-decode steps at once, with the same decisions;
* ``percentiles``: the one definition of a latency percentile;
* ``measure``, ``fit``, ``realtime``: measured engine steps, the cost model fitted to them, and the
  engine serving on the wall clock to test the fit;
* ``mooncake``: Mooncake's public conversation trace read into requests (chapter 07), and one LRU
  cache's hit rate against its capacity beside the paper's Fig. 9;
* ``tiers``: where a block can live (``Tier``, the presets ``TIERS``) and when moving it beats
  computing it again (``reload_seconds``, ``prefix_recompute_seconds``, ``break_even_tokens``,
  ``break_even_table``; chapter 08).
"""
