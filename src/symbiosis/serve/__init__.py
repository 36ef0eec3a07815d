"""`symbiosis serve`: the base model as a service. One process holds the executor (which split tenants may still
attach to), the hosted engine and an HTTP server speaking OpenAI's API to tenants with their own keys; what must
outlive the process is in an embedded SQLite database under the state directory."""
