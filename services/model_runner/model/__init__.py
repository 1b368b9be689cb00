"""The Llama-family decoder (Llama, Mistral, Qwen2): config, layers and the transformer."""
