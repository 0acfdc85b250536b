"""Kubernetes with KubeRay: manifests rendered from the config a job runs (`python -m
deploy.render`, `deploy.kuberay`), the image (`Dockerfile`) and the rendered manifests of
the GPU presets (`*.yaml`, checked against what the command renders today by a test)."""
