"""Tensor parallelism: one engine over N rank processes (`--tensor-parallel-size`).

Rank 0 is the engine a node serves from: it schedules, samples and owns the page pool.
Ranks 1..N-1 (`follower`) run every step's forward on their share of the weights and KV
heads, told what to run by rank 0 (`group`). How heads and weights split: `shard`.
"""
