"""Registers the offload-store fixtures (defined in offload_testlib.py)."""

from offload_testlib import db, make_core, make_pool

__all__ = ["db", "make_core", "make_pool"]
