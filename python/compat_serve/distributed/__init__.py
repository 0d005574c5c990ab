"""One model across several processes or machines (issue #28): MLX's own distributed
backends (ring over TCP, JACCL over RDMA), tensor or pipeline sharding from mlx-lm.

Rank 0 decides (HTTP, templates, scheduler, sampling); every step it sends its step plan
(engine/step_plan.py) to the other ranks, which only apply it to their shard
(`follower.py`). `startup.py` is the one entry point the CLI calls.
"""
