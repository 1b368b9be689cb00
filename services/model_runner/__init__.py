"""The model-runner: weights, the KV pool tensor, paged attention, sampling."""
