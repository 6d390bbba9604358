"""The GPU kit's runner (run_kit.py), in modules named for what they do:
common (shared helpers), base (environments, running programs), memory,
workloads, compute, agentview, overhead (the sections), budget (how long a
run takes), report and markdown (what it writes). Standard library only."""
