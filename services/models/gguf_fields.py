"""Reading GGUF metadata fields (shared by the weight and the tokenizer conversion)."""
from __future__ import annotations


def field_value(reader, key: str, default=None):
    """One metadata value as a Python scalar, str or list; `default` when absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()
