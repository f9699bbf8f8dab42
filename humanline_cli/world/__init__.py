"""The bundled world: a tiny tokenizer, a mediocre SFT starting policy,
off-policy offline data and reward functions, built locally on first use.

Consumes a plain-dict world cfg (`kind` plus optional overrides of
`defaults.DEFAULTS[kind]`) and a cache root; produces
`cache_root/<kind>-<hash12>/` holding `WORLD_FILES` (cache.py; the name:
naming.py; the build: make.py).
"""
