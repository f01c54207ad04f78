"""The coordinator process: HTTP APIs, validation, routing to (prefill, decode) worker pairs."""
