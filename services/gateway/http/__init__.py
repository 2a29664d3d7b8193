"""The gateway's http/ room: HTTP API: routes, SSE, OpenAPI, request context."""
