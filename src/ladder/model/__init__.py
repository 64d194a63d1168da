"""The model: its config, the decoder with every residual layout, its weights, and what names a model to load."""
