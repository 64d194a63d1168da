"""Quantized weights (torchao): int8 and int4 weight-only."""
