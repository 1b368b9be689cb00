"""Benchmarks (not tests): each prints its figures and writes JSON under bench/results/."""
