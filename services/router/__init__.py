"""The router: many replicas behind one ``kvmesh.v1.Scheduler`` front, routed by KV-cache hits."""
