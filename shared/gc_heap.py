"""The start-up heap moved out of the cyclic garbage collector's way.

Why: a service's heap after start-up is large and lives as long as the process (the imported
modules, torch's and transformers' objects, the model and its tables: ~180,000 tracked objects in
a model-runner with SmolLM2), and every full (generation 2) collection walks all of it. Serving
allocates short-lived objects on every step and every token (protobuf messages, lists, small
tensors); whenever enough of them survive the younger collections, a full collection runs on the
thread that allocated, a pause in the middle of a step or of a stream. ``gc.freeze()`` after
start-up moves the start-up heap to the permanent generation, which collections skip; what serving
allocates is still collected as before. vLLM's engine does the same once its model is loaded. The
measured pause: docs/lifecycle.md, "The start-up heap".
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collects once (so start-up's garbage is freed, not frozen), then freezes every object left.

    Returns:
        The number of objects now in the permanent generation.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
