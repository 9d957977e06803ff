"""Tools the model calls during an episode, and what runs them safely.

A tool is an async callable with type hints and a Google-style docstring, so its OpenAI
function schema comes from ``transformers.utils.get_json_schema``; a call that fails in a
contained way raises ``ToolError`` (the caller turns it into a ``tool`` message and counts
it). ``sandbox.py`` holds the ``python`` tool (``PythonTool``) and the sandbox that runs
the model's code in a confined child process (``Sandbox``, ``SandboxLimits``).
"""
