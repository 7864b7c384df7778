# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # C1 · Your own engine: your pieces serve the real model
#
# **The message.** The four pieces you wrote in chapters 01, 03, 04 and 05 are an engine's four
# decisions, and with them it serves SmolLM2 token for token as transformers does.
#
# Each build-it exercise judged one piece alone, on hidden cases. Here they work together. Your
# `decode_step` computes attention over the cache, your `Pager` hands out every block and slot, your
# `cached_tokens` decides each prefix hit, and your `plan_step` decides who runs each step, and with
# how many tokens. labkit supplies the weights, the K/V pools, the tokenizer, greedy sampling and the
# loop. Every call to one of your pieces is checked against labkit's answer to the same question, so a
# wrong piece is caught the first time it matters, and named.
#
# **What you will learn**
#
# - how the four pieces plug into one engine through narrow seams, and which decision each makes;
# - how sharing fits interfaces that know nothing of it;
# - how to find a wrong piece: the step, the request and the two answers.

# %%
from labkit.teaching.diagrams import roadmap

roadmap("C1");  # the article's pipeline: every part runs on your pieces here

# %% [markdown]
# **You need:** chapters 01 to 05, and their build-it exercises: `decode_step` (01), `Pager` (03),
# `cached_tokens` (04) and `plan_step` (05), in the chapter notebooks, saved. A piece still the stub
# is replaced by labkit's, so this notebook runs whatever you have done.
#
# **Time:** about 10 minutes to read and run; about 10 minutes for the exercise.

# %%
import torch

import labkit
from labkit.model.pretrained import chat_token_ids, from_pretrained, load_tokenizer, real_model, to_transformers
from labkit.serving.engine import Engine
from labkit.serving.pieces import Pieces
from labkit.teaching.capstone import PieceMismatch, lockstep, pieces_from_notebooks, report, serve
from labkit.teaching.exercises import Exercises

torch.set_num_threads(2)
print(labkit.describe())

# %% [markdown]
# ## 1. Your pieces
#
# `pieces_from_notebooks` reads the saved chapter notebooks in this folder. From each it takes the
# cell that defines your piece, with the notebook's imports, and runs only that definition, never
# the checker. A piece that still only raises `NotImplementedError` is left to labkit, and one line
# says so:

# %%
# NBVAL_CHECK_OUTPUT
yours, lines = pieces_from_notebooks(".")
print("\n".join(lines))

# %% [markdown]
# The seams are `labkit.serving.pieces`. `Engine(model, ..., pieces=...)` is the engine of chapter 05
# with its four decisions handed to the pieces, and nothing else changed. A seam left `None` gets
# labkit's own answer to the same exercise: `Pieces()` is labkit's engine of the article.
#
# | seam | it decides | the engine asks it |
# |---|---|---|
# | `plan_step` (05) | who runs, with how many tokens; whom to preempt | once a step, on rows built from the requests |
# | `cached_tokens` (04) | how many prompt tokens a waiting request finds cached | once a step per waiting request |
# | `Pager` (03) | which block and slot every token's K/V go to | whenever a chunk needs room; when a request leaves |
# | `decode_step` (01) | attention, with RoPE at the cache length | per token, layer and request |
#
# Two of the interfaces know nothing of sharing. A `Pager` sequence owns its blocks alone, and a
# preempted `plan_step` row gives back everything it holds. So the engine makes each full prompt block
# a `Pager` sequence of its own, with a count of the requests that hold it, and leaves blocks that
# others hold too out of a request's row. The plan then stays exact. The attention step turns `q` and
# `k` itself, so the model hands them over at position 0, a turn that changes nothing
# (`StepwiseKV.rope_positions`).
#
# ## 2. A workload that needs all four
#
# One system prompt for everyone. Two users send the same notes with different questions at the same
# moment: the first gets a two-token answer and leaves. Three short chats follow. At step 4, a user
# asks the second notes question again. Blocks of 8 tokens, a budget of 128 tokens a step, and a pool
# of 20 blocks, too small to hold every request to its end:

# %%
# NBVAL_SKIP_IN_CHAPTERS
path = real_model()
real = from_pretrained(path, dtype=torch.float32, device=labkit.DEVICE)
tokenizer = load_tokenizer(path)
system = {"role": "system", "content": "You are a helpful assistant. Explain things clearly, in a few sentences."}
notes = ("Notes: the water cycle moves water between oceans, air and land. The sun heats the sea; vapour "
         "rises, cools into clouds and falls as rain or snow.")
asks = [(1, "notes-a", notes + " Question: what heats the sea?", 2),
        (1, "notes-b", notes + " Question: what falls from clouds?", 10),
        (1, "cpu", "How does a CPU work?", 8), (1, "vaccines", "How do vaccines work?", 8),
        (1, "seasons", "Why do we have seasons?", 8),
        (4, "notes-b again", notes + " Question: what falls from clouds?", 6)]
workload = [(step, name, chat_token_ids(tokenizer, [system, {"role": "user", "content": q}]), limit)
            for step, name, q, limit in asks]
SETTINGS = dict(num_blocks=20, block_size=8, max_num_batched_tokens=128)
print({name: len(prompt) for _, name, prompt, _ in workload}, "prompt tokens")

# %% [markdown]
# ## 3. Run it on your pieces
#
# `lockstep` wraps your pieces: each call also asks labkit's piece the same question, and
# stops the run at the first answer that differs. The reference run uses labkit's pieces alone (with
# every seam still labkit's, the run itself is the reference).

# %%
# NBVAL_SKIP_IN_CHAPTERS
# NBVAL_CHECK_OUTPUT
engine = Engine(real, **SETTINGS, pieces=lockstep(yours))
requests = serve(engine, workload)
replies = {name: r.output_token_ids for name, r in requests.items()}
reference, ref_requests = engine, requests  # every seam labkit's: this run is the reference
if yours != Pieces():
    reference = Engine(real, **SETTINGS, pieces=Pieces())
    ref_requests = serve(reference, workload)
assert {name: r.output_token_ids for name, r in ref_requests.items()} == replies
for piece, what in report(engine):
    print(f"{piece:20} {what}")
print("prompt tokens found cached:", {name: r.num_cached_tokens for name, r in requests.items()})

# %% [markdown]
# The table shows every piece at work: the `Pager` handed out more blocks than the pool holds,
# because blocks came back and went out again; `cached_tokens` found the system prompt's blocks for
# requests admitted while another held them; `plan_step` preempted. The asserts hold the run to
# that, and to labkit's pieces step by step:

# %%
# NBVAL_SKIP_IN_CHAPTERS
stats, ref_stats = engine.stats, reference.stats
assert sum(s.preemptions for s in stats) >= 1 and sum(s.prefix_hit_tokens for s in stats) >= 1
assert [(s.scheduled_tokens, s.prefix_hit_tokens, s.preemptions, s.free_blocks) for s in stats] == \
    [(s.scheduled_tokens, s.prefix_hit_tokens, s.preemptions, s.free_blocks) for s in ref_stats]
assert engine.scheduler.pool.blocks_taken > SETTINGS["num_blocks"]
assert [r.num_cached_tokens for r in requests.values()] == [r.num_cached_tokens for r in ref_requests.values()]
print(f"{len(stats)} steps, {sum(s.preemptions for s in stats)} preemption(s), the same as with labkit's pieces")

# %% [markdown]
# The verdict is the model's output. transformers' own Llama (`to_transformers`, the same weights)
# generates each reply alone, greedily, with its own attention and cache. Paging, sharing, chunking
# and the preemption must not have changed one token:

# %%
# NBVAL_SKIP_IN_CHAPTERS
hf = to_transformers(real)
stop = real.config.eos_token_id
for _, name, prompt, limit in workload:
    ids = torch.tensor([prompt], device=labkit.DEVICE)
    alone = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=limit, do_sample=False,
                        eos_token_id=stop, pad_token_id=stop)[0, len(prompt):].tolist()
    assert replies[name] == alone, name
    print(f"{name:14} {tokenizer.decode(replies[name], skip_special_tokens=True)!r}")
print("your engine == transformers' generate, token for token, for all six requests")

# %% [markdown]
# Look at "notes-b again". Its prompt is the one "notes-b" sent, and "notes-b" was still running
# when it came. Yet the run finds only the system prompt cached, two blocks, 16 tokens. The notes'
# blocks left with "notes-a": "notes-b" had computed the same notes beside it in step 1, when nothing
# was cached yet, and this engine gives each name to one block only, so its copies carry no names
# (vLLM names such twins too: `BlockHashToBlockMap` in `vllm/v1/core/block_pool.py`). Its later
# blocks do carry names, and chapter 04's rule says they count for nothing after a gap:

# %%
# NBVAL_SKIP_IN_CHAPTERS
cpu, again = requests["cpu"].prompt_token_ids, requests["notes-b again"].prompt_token_ids
common = next(i for i, (a, b) in enumerate(zip(cpu, again)) if a != b)  # tokens every chat shares
system_tokens = common // 8 * 8  # in full blocks of 8
print(f"'notes-b again': {requests['notes-b again'].num_cached_tokens} prompt tokens cached of "
      f"{len(requests['notes-b again'].prompt_token_ids)}; every chat shares its first {common} tokens, {system_tokens} of them in full blocks")
assert requests["notes-b again"].num_cached_tokens == system_tokens == 16

# %% [markdown]
# ## 4. When a piece is wrong
#
# A wrong piece stops the run with a `PieceMismatch`. The message names the piece, the step and the
# request, and for an attention step the layer and position too. It then shows your answer beside
# labkit's. Fix the piece in its chapter, save that notebook, and run this one again.

# %% [markdown]
# CHAPTER ONLY
# In `solutions/`, this section runs four deliberately wrong pieces, each a mistake that passes a
# careless test, and shows each one caught and named.

# %% [markdown]
# SOLUTIONS ONLY
# Four deliberately wrong pieces from `labkit.teaching.capstone`, each the mistake a careless test
# lets through, each run with labkit's pieces in the other three seams:
#
# - a `Pager` that takes new blocks from the top of its free list without removing them: its free
#   count is right, its blocks are not;
# - a `cached_tokens` that keeps counting after a miss;
# - a `plan_step` that preempts the oldest running request, not the newest;
# - a `decode_step` that skips the 1/√D scale (here: it scales `q` up by √D first, which cancels it).

# %%
# SOLUTIONS ONLY
from labkit.teaching.capstone import WRONG_PIECES, PeekingPager, counting_on, oldest_first, unscaled
from labkit.teaching.excerpts import excerpt

excerpt(PeekingPager.append, "blocks, self.taken")  # the Pager: new blocks left in the free list
excerpt(counting_on, "return")                      # cached_tokens: no stop at a miss
excerpt(oldest_first, "return")                     # plan_step: the oldest gives its blocks back
excerpt(unscaled, "return")                         # decode_step: q * sqrt(D) cancels the 1/sqrt(D)

caught = {}
for seam, wrong in WRONG_PIECES.items():
    try:
        serve(Engine(real, **SETTINGS, pieces=lockstep(Pieces(**{seam: wrong}))), workload)  # labkit's elsewhere
    except PieceMismatch as err:
        caught[seam] = err
        print(f"{err}\n")
assert sorted(caught) == sorted(["Pager", "cached_tokens", "plan_step", "decode_step"])
assert all(err.where.get("step") and err.where.get("request") is not None for err in caught.values())

# %% [markdown]
# Each was caught at its first wrong answer, and named: the `Pager` in step 1, the moment it
# handed out a block that was already in use; `cached_tokens` at "notes-b again", whose
# named blocks after the gap it counted; `plan_step` at the step that preempted; the attention
# step at position 1 of layer 0, the first attention over two positions (over one position the
# softmax is 1 whatever the scale).

# %%
ex = Exercises("C1_your_own_engine")

# %% [markdown]
# **Quiz.** Answer with a letter.
# 1. "notes-b again" found 16 tokens cached, although later blocks of its prompt were named. Why does
#    `cached_tokens` stop at 16? (a) those named blocks are stale; (b) a block's name vouches for its
#    whole prefix, and the blocks before them had no name; (c) the pool had no room for a longer hit.
# 2. Why does `StepwiseKV` give the model position 0 for every token? (a) `decode_step` turns `q` and
#    `k` to the cache length itself, and a turn by 0 changes nothing; (b) positions do not matter once
#    K/V are cached; (c) SmolLM2 does not use RoPE.
# 3. The `Pager` handed out more blocks than the pool holds. How? (a) blocks came back when requests
#    finished or were preempted, and went out again; (b) it lent more blocks than it had; (c) each of
#    the 30 layers takes its own blocks.

# %%
# BEGIN SOLUTION
quiz = {1: "b", 2: "a", 3: "a"}
# END SOLUTION
# BEGIN STUB
quiz = {1: None, 2: None, 3: None}  # a letter each
# END STUB
ex.quiz(quiz)

# %% [markdown]
# ## What you can now do
#
# - Serve a real model on pieces you wrote, and prove its tokens equal transformers'.
# - Say which decision of an engine each piece makes, and where the engine asks for it.
# - Find a wrong piece by the first step and request where it differs from a reference.
#
# Part II goes past one engine: [chapter 07](07_many_replicas.ipynb) puts many replicas behind a router, and
# then the cache itself moves.
