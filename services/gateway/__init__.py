"""The OpenAI-compatible HTTP front door: translates to the scheduler's gRPC API, holds no engine state."""
