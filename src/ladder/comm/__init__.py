"""Communication: the `Communicator` protocol the model talks through (`base`), real process groups
(`distributed`), link models and their presets (`links`), emulated links that wait instead of
communicating (`emulated`), and starting N ranks (`launch`)."""
