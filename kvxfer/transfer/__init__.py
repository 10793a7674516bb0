"""The transfer core: descriptor planning, producer holds, consumer loads, aggregation."""
