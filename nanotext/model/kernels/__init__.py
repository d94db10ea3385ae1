"""Attention kernels, one per file; `dispatch` is the one place that picks among them."""
