"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3): config, layers, the transformer, packed weights.

``transforms.py`` prepares a loaded model from outside: packing, and the native backend.
"""
