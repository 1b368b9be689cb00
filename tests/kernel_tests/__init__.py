"""Tests of the kernels: native CPU (``services/model_runner/native``) and Triton (interpreted).

Why this package is not named ``kernels``: pytest puts ``tests/`` on ``sys.path`` for it, and a
top-level ``kernels`` shadows Hugging Face's ``kernels`` package, which transformers 5.25 imports
while loading its model classes (``from kernels import CUDAProperties`` failed in every test that
imported a model)."""
