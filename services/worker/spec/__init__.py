"""Speculative decoding on the worker: proposers (ngram.py, suffix.py), exact verification
(verify.py) and the choice of how many draft tokens to propose (dynamic_k.py)."""
