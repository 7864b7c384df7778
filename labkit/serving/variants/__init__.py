"""Schedulers beside the core, each a subclass that changes it through one hook the core names.

* ``forking``: ``ForkingScheduler.fork``, parallel sampling with shared blocks and copy-on-write (04, 05);
* ``priority``: ``PriorityScheduler``, the waiting queue ordered by a key (05, A5);
* ``reservation``: ``ReservingScheduler``, the PagedAttention paper's baselines that reserve at admission (03, A6);
* ``tiered``: ``TieredScheduler``, over a prefix cache with a second tier, its loads recorded in each step's
  stats, and ``TieredSimulator``, which times them, taken only when moving beats computing again (08).
"""
