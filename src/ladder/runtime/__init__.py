"""Running a model: the engine and its decode steps, sampling, detokenizing, memory and limits."""
