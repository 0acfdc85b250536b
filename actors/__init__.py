"""The vLLM engine wrapper (`actors.engine`, the only module that imports vLLM's engine)
and what it carries: request validation, spec-decode statistics, the live speculation
controller and the engine-core utilities it drives. The hosts that put an engine in a Ray
actor are the Ray Data stage (`actors.batch_host`) and the Serve replica
(`serving.app`).

Importing `actors` itself is light; submodules are imported where they are used.
"""
