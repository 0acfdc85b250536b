"""Running untrusted, model-written Python: `sandbox.launch` (the caller's side: builds the
boundary with what Linux ships and returns a status) and `sandbox.pid1` (stage 2, PID 1
inside the boundary; standard library only). Imports nothing from the project but
`configs.sandbox_limits`; knows nothing about Ray, S3 or scoring.
"""
