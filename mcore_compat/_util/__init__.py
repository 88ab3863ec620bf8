"""Small helpers shared by the feature packages, each one job and no knowledge of releases.

``deprecated`` (the table of deprecated public names and parameters, and the warn-once alias machinery),
``optimizer_view`` (what a Megatron optimizer really updates: main params, their model params, groups, state),
``rank_coords`` (this rank's place in the parallel layout, read from ``parallel_state``), ``gc`` (the cyclic garbage
collector paused around allocation-heavy work), ``own_math`` (marks a function whose tensor math is ours, for the
CPU harness), ``warm_cpu`` (the fork server's warm start for CPU ranks) and ``pipes`` (a command-line exit that
survives a closed pipe).
"""
