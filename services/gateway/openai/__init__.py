"""The gateway's openai/ room: OpenAI semantics: request models, choices, logprobs, stop strings, response shapes."""
