"""Measuring: this machine's profile (calibrate, microbenchmarks), profiled runs, the dry
run on fake tensors and per-rank peak memory."""
