"""Engine actors: the vLLM engine wrapper (`actors.engine`, the only module that imports
vLLM's engine), the Ray actor hosting it, and the pool that dispatches to them.

Importing `actors` itself is light; submodules are imported where they are used.
"""
