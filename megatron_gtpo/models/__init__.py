"""Model assets available offline (the SmolLM2-135M-Instruct wheel)."""
