"""The OpenAI-compatible API server: the gateway, tokenize, admission, stream and metering
stations in front of an engine worker process."""
