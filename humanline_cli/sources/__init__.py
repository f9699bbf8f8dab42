"""Data sources: what the training loop pulls one optimizer step at a time.

Both yield `StepData` (the micro-batches of one step), so the loop cannot tell a fixed offline file
(`OfflineSource`) from online rounds of sample -> label -> feedback (`OnlineSource`). The builder
(train/build.py) constructs them from ready parts: units or prompt rows, an encoder, a collator, a
sampler and a labeller.
"""
