"""One process per rank: DP attention (each rank its own requests and caches) and EP MoE (routed experts
sharded over the ranks, tokens exchanged through all-to-all).

``config``: the layout and its checks (before any weights load); ``groups``: torch.distributed setup;
``ep``: expert placement, dispatch and combine; ``dp``: which rank takes a new request; ``messages``: what
the API process and the ranks send each other; ``text``: detokenization and stop strings in the API
process; ``rank_main``: the engine process of one rank; ``ranked_engine``: the API process's side (starts
the ranks, routes requests, gathers their outputs, notices a rank that dies).
"""
