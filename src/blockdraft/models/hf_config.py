"""The language model's own part of a Hugging Face config."""

from __future__ import annotations


def text_config(config):
    """A multimodal model's `text_config` (Gemma 3 keeps the language model's sizes there), else the config itself;
    `config` may be a config object or its JSON dict."""
    if isinstance(config, dict):
        return config.get("text_config") or config
    return getattr(config, "text_config", None) or config
