"""Test fixtures that start real clusters: a single-node Slurm and pretend hosts in network namespaces."""
