"""The Llama-family decoder (Llama, Mistral, Qwen2): config, layers, the transformer, packed linear weights."""
