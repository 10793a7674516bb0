"""The reference engine: a small transformer served as prefill, decode or combined instances,
a router in front, and a launcher that runs a workload through them."""
