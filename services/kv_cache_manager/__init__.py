"""The kv-cache-manager: block pool, block tables, ref counts, prefix hashes, KV events."""
