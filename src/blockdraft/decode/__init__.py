"""Decoding: the engine that drives a target and a proposer over one or many sequences (`engine.py`)."""
