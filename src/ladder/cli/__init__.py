"""The `ladder` command line: one module per command (`generate`, `evaluate`, `convert`, `bench`, `predict`,
`train`), what they share (`common`), and the entry point (`main`). Each is a thin layer over typed
functions of the package; every user error is a `LadderError`, printed as one line."""
