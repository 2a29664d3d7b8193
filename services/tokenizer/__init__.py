"""The tokenizer service: text <-> token ids, chat templates, incremental detokenization."""
