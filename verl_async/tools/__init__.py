"""Tools in the ecosystem's form, and what runs them safely (docs/agents.md).

- ``schemas.py``: a tool is a Python callable and its OpenAI function schema, derived by
  ``transformers.utils.get_json_schema`` from type hints and a Google-style docstring, or
  written out; an environment's methods as tools; arguments checked against the schema.
- ``parsers.py``: the calls a model writes, read by its family's parser (vLLM's).
- ``chat_templates.py``, ``templates/``: the shipped tool templates.
- ``sandbox.py``: the ``python`` tool (``PythonTool``) and the sandbox that runs the model's
  code in a confined child process (``Sandbox``, ``SandboxLimits``); a call that fails in a
  contained way raises ``ToolError``, which the caller answers as an error and counts.
"""
