"""Data: loading files with `datasets`, converting rows to objective units, tokenising, batching."""
