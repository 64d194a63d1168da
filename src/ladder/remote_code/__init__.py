"""The configuration and modeling files ladder writes into every non-standard Hugging Face folder, so
that transformers runs its layout (`trust_remote_code=True`). They import nothing from ladder: the
folder must work where ladder is not installed. Nothing in ladder imports them; `ladder.checkpoint.hf`
copies them."""
