"""What a CPU needs that a GPU does not: linear layers in the layouts its kernels read fastest, and a fix for inductor's CPU fusion."""
