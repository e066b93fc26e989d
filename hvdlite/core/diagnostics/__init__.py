"""Diagnostics beyond the collectives: the user's call site of each op, and the replica-divergence check."""
