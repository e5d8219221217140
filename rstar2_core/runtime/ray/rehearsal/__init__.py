"""The rehearsal harness: a multi-node Ray cluster of local raylets on this machine (local_cluster.py),
what `rstar2 cluster up` starts and the multi-node tests run on.

It lives apart from the runtime a stage runs: nothing in rstar2_core imports this package (the CLI, the
tests and the benchmarks do). The `kill-node` fault reaches a local raylet through the runtime's node
killer (runtime/ray/node_kill.py), which this harness reuses, not the other way round.
See docs/cluster.md, "Rehearse a cluster run on one machine".
"""
