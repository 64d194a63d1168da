"""Checkpoints in and out: GGUF files (`gguf`) and Hugging Face folders (`hf`, the one writer),
their tokenizers and chat templates (`tokenizer`), and names that stand for installed files (`resolve`)."""
