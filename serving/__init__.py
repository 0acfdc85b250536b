"""The online door: a Ray Serve app whose replicas are the engine actors.

`serving.app` is the deployment (vLLM's own OpenAI layer over our `Engine`, plus a batch
method), `serving.middleware` our HTTP guards, `serving.metrics` per-replica Prometheus
export through Ray's metrics.
"""
