"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over the gateway's
chat machinery: request models (protocol.py), Messages <-> chat (convert.py), the streamed
events (events.py) and Anthropic's error shape (errors.py). Routes: http/messages.py."""
