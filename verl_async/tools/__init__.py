"""Tools in the ecosystem's form: OpenAI function schemas, a chat template that teaches them,
and parsers for the calls a model writes (see each module's docstring)."""
