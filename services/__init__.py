"""The kvmesh services: one package each, plus the ``kvmesh`` command line."""
