"""The gateway's clients/ room: clients of other services: engine stream, engine pool and router, tokenizer, embedder, supervisor."""
