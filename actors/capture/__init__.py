"""Trace capture: train a workload on every rank (or on a fake device) and record one
iteration's ET; the names it gives files, ranges and markers are in actors/trace/conventions.py."""
